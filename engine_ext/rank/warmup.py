"""Warm-up and capture: release graphs, right-size the workspace for the new world and give
the difference to the KV pool, run an isolated warm-up batch, capture once, lock the workspace
at exactly the size the world needs (invariants I3, I4, I5, I7)."""

from __future__ import annotations

import hashlib
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from engine_ext.model.model import Batch
from engine_ext.rank.scheduler import NULL_BLOCK
from engine_ext.protocol import RankState

if TYPE_CHECKING:
    from engine_ext.rank.engine import RankEngine


class WarmupIsolationError(RuntimeError):
    """The warm-up changed serving state (slots, block tables, live KV or EPLB load): serving
    must not resume on it."""


class Warmup:
    """Warm-up and capture of one rank, run in lockstep on every rank of its group."""

    def __init__(self, engine: RankEngine) -> None:
        self.engine = engine
        faults = engine.faults
        engine.graphs.world_key = lambda: (id(engine.group) if engine.group is not None else 0, engine.world_size)
        engine.graphs.verify = not faults.active("no_stale_check")
        model, cfg = engine.model, engine.cfg
        self.block_bytes = model.kv[:, : cfg.block_size].numel() * model.kv.element_size()
        # The rank's memory budget for KV + MoE workspace: every block at world 1.
        self.memory_budget = cfg.num_blocks * self.block_bytes + model.moe_workspace_bound(1)

    def live_kv_checksum(self) -> str:
        """A digest of the KV blocks live requests hold: warm-up must leave it unchanged (I5)."""
        e = self.engine
        blocks = e.sched.live_blocks()
        if not blocks:
            return "empty"
        bs = e.cfg.block_size
        idx = torch.tensor([b * bs + j for b in blocks for j in range(bs)], device=e.device)
        data = e.model.kv[:, idx].contiguous().cpu()
        return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]

    def _live_slot_state(self) -> tuple[tuple[int, ...], list[list[int]]]:
        """The free-slot list and the block-table rows of the slots live requests hold."""
        e = self.engine
        live = sorted(r.slot for r in e.sched.running)
        rows = e.model.block_table[live].tolist() if live else []
        return e.sched.slots.snapshot(), rows

    def kv_pool_blocks(self, workspace_bytes: int) -> int:
        """KV blocks (null block excluded) the budget leaves beside a workspace of this size."""
        return (self.memory_budget - workspace_bytes) // self.block_bytes - 1

    def warm_and_capture(self, op_id: str) -> dict[str, Any]:
        """Release graphs -> unlock -> right-size -> KV pool -> isolated warm-up -> capture once -> lock."""
        e = self.engine
        faults = e.faults
        reuse = e.capture_reuse
        if reuse is not None:  # capture_policy=reuse: survivors keep their captures, joiners capture locally
            if op_id != "startup":
                return reuse.transition(op_id) if e.graphs.captured_sizes else reuse.join(op_id)
            reuse.size_at_start()
        report: dict[str, Any] = {"workspace_before": e.workspace.nbytes, "kv_blocks_before": e.sched.blocks.total}
        if not faults.active("skip_release"):
            report["graphs_released"] = e.graphs.release()
        e.telemetry.set_state(RankState.WARMING)
        faults.hold("warm")
        bound = e.model.moe_workspace_bound(e.world_size if reuse is None else reuse.capacity)
        with e.telemetry.phase(op_id, "warm") as d:
            e.workspace.unlock()
            e.required_workspace = bound
            if not (faults.active("skip_rewarm") and op_id != "startup"):
                e.workspace.reserve(bound)
                with e.lock:
                    e.sched.blocks.resize(self.kv_pool_blocks(e.workspace.nbytes))
            d["kv_blocks_total"] = e.sched.blocks.total
            d.update(self.isolated_warmup())
            d["workspace_bytes"] = e.workspace.nbytes
            d["required_bytes"] = bound
            report.update(d)
            broken = [k for k in ("slots_restored", "live_kv_unchanged", "eplb_unchanged") if not d[k]]
            # One verdict for the group: every rank stops together, none waits in a capture collective.
            flag = torch.tensor([1 if broken else 0], dtype=torch.int64)
            anyone = bool(e.group.all_reduce_max(flag)[0]) if e.group is not None else bool(broken)
            if anyone and not faults.active("no_warmup_check"):
                where = (f"{', '.join(broken)} false; live KV checksum {d['live_kv_checksum']} -> "
                         f"{d['live_kv_after']}") if broken else "on another rank of the group"
                raise WarmupIsolationError(f"warm-up touched serving state ({where})")
        # "skip_release" keeps the old captures (none are made where none were released);
        # "double_capture" reproduces upstream before its fix: the re-warm captured a second time.
        if faults.active("skip_release") and op_id != "startup":  # every rank alike: captures are collective
            passes = 0
        else:
            passes = 2 if faults.active("double_capture") else 1
        for _ in range(passes):
            e.telemetry.set_state(RankState.CAPTURING)
            faults.hold("capture")
            e.graphs.begin_pass()
            with e.telemetry.phase(op_id, "capture") as d, (reuse.detached() if reuse else nullcontext()):
                t0 = time.perf_counter()
                for size in e.cfg.capture_sizes:
                    self.capture(size)
                d["sizes"] = list(e.cfg.capture_sizes)
                d["per_size_s"] = {str(k): round(v, 6) for k, v in e.graphs.stats.capture_durations.items()}
                d["total_s"] = time.perf_counter() - t0
                d["graphs_this_op"] = e.graphs.stats.captures_this_op
                d["graph_kind"] = e.graphs.kind
        e.capture_passes = e.graphs.passes_this_op
        # The lock admits only the size this world needs: a skipped re-warm fails here, both ways.
        with e.telemetry.phase(op_id, "lock", capture_passes=e.graphs.passes_this_op, required_bytes=bound,
                               capture_policy=e.cfg.capture_policy, expected_passes=1) as d:
            d["workspace_bytes"] = e.workspace.nbytes
            e.workspace.lock(None if faults.active("no_lock_check") else bound)
        report["workspace_after"] = e.workspace.nbytes
        report["kv_blocks_after"] = e.sched.blocks.total
        report["captures_this_op"] = e.graphs.passes_this_op
        return report

    def isolated_warmup(self) -> dict[str, Any]:
        """A max_num_tokens batch through the real slot, block-table and KV path, touching no
        serving state (I5): only slots free on every rank, their rows pointing at the null block,
        and no EPLB load recorded."""
        e = self.engine
        cfg, sched, model = e.cfg, e.sched, e.model
        broken = e.faults.active("warmup_not_isolated")
        record_load = e.faults.active("eplb_not_suppressed")
        slots_before = self._live_slot_state()
        kv_before = self.live_kv_checksum()
        eplb_before = e.eplb.snapshot()
        load_before = model.expert_load.clone()
        # The synthetic batch may use only slots that are free on every rank.
        free = torch.tensor([-sched.slots.free], dtype=torch.int64)
        min_free = -int(e.group.all_reduce_max(free)[0]) if e.group else sched.slots.free
        n = cfg.max_num_tokens
        live = sched.live_blocks()
        if broken:
            # Takes every slot, live or not, and points its row at live blocks (upstream's dummy
            # run sharing the serving request state): live requests then read the dummy's KV.
            taken = list(range(cfg.max_num_seqs))
            for i, s in enumerate(taken):
                model.set_slot_blocks(s, [live[(i + j) % len(live)] for j in range(cfg.max_blocks_per_seq)]
                                      if live else [])
        else:
            taken = [sched.slots.allocate() for _ in range(max(0, min(min_free, cfg.max_num_seqs)))]
            for s in taken:
                model.set_slot_blocks(s, [NULL_BLOCK] * cfg.max_blocks_per_seq)
        dev = e.device
        per = max(1, -(-n // max(1, len(taken))))
        req_slots = [taken[i // per] if taken else model.null_slot for i in range(n)]
        positions = [i % per for i in range(n)]
        g = torch.Generator().manual_seed(1234 + e.rank)
        batch = Batch(torch.randint(0, cfg.vocab_size, (n,), generator=g).to(dev),
                      torch.tensor(positions, device=dev), torch.tensor(req_slots, dtype=torch.int64, device=dev),
                      torch.ones(n, dtype=torch.bool, device=dev))
        model.forward(batch, e.group, e.workspace, record_load=record_load)
        if not broken:
            for s in reversed(taken):
                sched.slots.release(s)
        kv_after = self.live_kv_checksum()
        return {
            "warmup_requests": len(taken),
            "warmup_tokens": n,
            "min_free_slots": min_free,
            "slots_restored": self._live_slot_state() == slots_before,
            "live_kv_unchanged": kv_after == kv_before,
            "eplb_unchanged": e.eplb.snapshot() == eplb_before and torch.equal(model.expert_load, load_before),
            "live_kv_checksum": kv_before,
            "live_kv_after": kv_after,
        }

    def capture(self, size: int) -> None:
        """Capture the decode step for ``size`` sequences against static input buffers; the plan
        binds its tensors now, so replays read exactly these."""
        e = self.engine
        cfg, dev, model = e.cfg, e.device, e.model
        inputs = {
            "token_ids": torch.zeros(size, dtype=torch.int64, device=dev),
            "positions": torch.zeros(size, dtype=torch.int64, device=dev),
            # The null slot, so the capture run itself writes only the null block.
            "req_slots": torch.full((size,), model.null_slot, dtype=torch.int64, device=dev),
            "valid": torch.zeros(size, dtype=torch.bool, device=dev),
        }
        output = torch.zeros(size, cfg.vocab_size, dtype=model.dtype, device=dev)
        batch = Batch(inputs["token_ids"], inputs["positions"], inputs["req_slots"], inputs["valid"])
        group = e.group if e.capture_reuse is None else e.capture_reuse.handle  # reuse: sized for max DP
        steps, ns = model.plan(batch, group, e.workspace, dense_moe=True, bind_workspace=True)  # type: ignore[arg-type]
        steps = [*steps, ("compute", lambda: output.copy_(ns["logits"]))]
        e.graphs.capture(size, inputs, output, steps)
