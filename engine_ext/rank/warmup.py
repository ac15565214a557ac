"""Warm-up and capture: release graphs, right-size the workspace for the new world and give
the difference to the KV pool, run an isolated warm-up batch, capture once, lock the workspace
at exactly the size the world needs (invariants I3, I4, I5, I7)."""

from __future__ import annotations

import hashlib
import time
from contextlib import nullcontext
from typing import Any

import torch

from engine_ext.model.model import Batch
from engine_ext.protocol import RankState
from engine_ext.rank.capture_reuse import CaptureReuse
from engine_ext.rank.scheduler import NULL_BLOCK
from engine_ext.rank.shared import RankResources, RankShared
from engine_ext.rank.telemetry import RankTelemetry

POOL_OP = "pool"  # what a capture taken in the standby pool, before any operation, is labelled with


class WarmupIsolationError(RuntimeError):
    """The warm-up changed serving state (slots, block tables, live KV or EPLB load): serving
    must not resume on it."""


class Warmup:
    """Warm-up and capture of one rank, run in lockstep on every rank of its group, under either
    capture policy (``reuse`` is None under ``recapture``)."""

    def __init__(
        self, res: RankResources, shared: RankShared, telemetry: RankTelemetry, reuse: CaptureReuse | None
    ) -> None:
        self.res = res
        self.shared = shared
        self.telemetry = telemetry
        self.reuse = reuse
        model, cfg = res.model, res.cfg
        self.block_bytes = model.kv[:, : cfg.block_size].numel() * model.kv.element_size()
        # The rank's memory budget for KV + MoE workspace: every block at world 1.
        self.memory_budget = cfg.num_blocks * self.block_bytes + model.moe_workspace_bound(1)
        # Under reuse, a standby's warm-up and capture pass taken in the pool (``capture_in_pool``):
        # its timings, until the commit of the operation that adopts it reports them.
        self.pool: dict[str, Any] | None = None

    def live_kv_checksum(self) -> str:
        """A digest of the KV blocks live requests hold: warm-up must leave it unchanged (I5)."""
        res = self.res
        blocks = res.sched.live_blocks()
        if not blocks:
            return "empty"
        bs = res.cfg.block_size
        idx = torch.tensor([b * bs + j for b in blocks for j in range(bs)], device=res.device)
        data = res.model.kv[:, idx].contiguous().cpu()
        return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]

    def _live_slot_state(self) -> tuple[tuple[int, ...], list[list[int]]]:
        """The free-slot list and the block-table rows of the slots live requests hold."""
        sched = self.res.sched
        live = sorted(r.slot for r in sched.running)
        rows = self.res.model.block_table[live].tolist() if live else []
        return sched.slots.snapshot(), rows

    def kv_pool_blocks(self, workspace_bytes: int) -> int:
        """KV blocks (null block excluded) the budget leaves beside a workspace of this size."""
        return (self.memory_budget - workspace_bytes) // self.block_bytes - 1

    def warm_and_capture(self, op_id: str) -> dict[str, Any]:
        """Ready the rank's captures for the world ``op_id`` made; its replays count afresh from here."""
        report = self._warm_and_capture(op_id)
        self.res.graphs.open_window(op_id)
        return report

    def _warm_and_capture(self, op_id: str) -> dict[str, Any]:
        """Release graphs -> unlock -> right-size -> KV pool -> isolated warm-up -> capture once -> lock."""
        res, faults, telemetry = self.res, self.res.faults, self.telemetry
        graphs, workspace = res.graphs, res.workspace
        reuse = self.reuse
        if reuse is not None:  # capture_policy=reuse: survivors keep their captures, joiners capture locally
            if op_id != "startup":
                # A joiner holds no captures; with no capture sizes configured, none does, and a
                # joiner is the rank whose workspace was never locked.
                if not graphs.captured_sizes and (res.cfg.capture_sizes or not workspace.locked):
                    return self._join_under_reuse(op_id, reuse)
                if self.pool is not None:  # adopted from the pool, its captures already taken
                    return self._join_with_pool_capture(op_id, reuse)
                return reuse.transition(op_id)
            reuse.size_at_start()
        # Release and re-capture belong together; "skip_release" switches both off in a transition,
        # so the old captures stay (I3) and no pass is made (I4).
        recapture = op_id == "startup" or not faults.active("skip_release")
        report: dict[str, Any] = {"workspace_before": workspace.nbytes, "kv_blocks_before": res.sched.blocks.total}
        if recapture:
            report["graphs_released"] = graphs.release()
        telemetry.set_state(RankState.WARMING)
        if op_id != "startup":  # a hold is a window in a transition or recovery (a startup one only delayed `up`)
            faults.hold("warm")
        bound = res.model.moe_workspace_bound(self.shared.world_size if reuse is None else reuse.capacity)
        report.update(self._warm(op_id, bound, resize=not (faults.active("skip_rewarm") and op_id != "startup")))
        # "double_capture" reproduces upstream before its fix: the re-warm captured a second time.
        passes = (2 if faults.active("double_capture") else 1) if recapture else 0
        for _ in range(passes):
            self._capture_pass(op_id)
        self.shared.capture_passes = graphs.passes_this_op
        # The lock admits only the size this world needs: a skipped re-warm fails here, both ways.
        with telemetry.phase(
            op_id,
            "lock",
            capture_passes=graphs.passes_this_op,
            required_bytes=bound,
            capture_policy=res.cfg.capture_policy,
            expected_passes=1,
        ) as d:
            d["workspace_bytes"] = workspace.nbytes
            workspace.lock(None if faults.active("no_lock_check") else bound)
        report["workspace_after"] = workspace.nbytes
        report["kv_blocks_after"] = res.sched.blocks.total
        report["captures_this_op"] = graphs.passes_this_op
        return report

    def _resize(self, bound: int) -> None:
        """Unlock, reserve the workspace this world needs and give the rest of the budget to KV."""
        res = self.res
        res.workspace.unlock()
        self.shared.required_workspace = bound
        res.workspace.reserve(bound)
        with self.shared.lock:
            res.sched.blocks.resize(self.kv_pool_blocks(res.workspace.nbytes))

    def _warm(self, op_id: str, bound: int, *, resize: bool) -> dict[str, Any]:
        """Right-size (unless the re-warm is skipped) and run the isolated warm-up; one verdict
        for the group, so every rank stops together and none waits in a capture collective."""
        res, faults = self.res, self.res.faults
        with self.telemetry.phase(op_id, "warm") as d:
            if resize:
                self._resize(bound)
            else:  # skip_rewarm: the workspace keeps the size it had, unlocked
                res.workspace.unlock()
                self.shared.required_workspace = bound
            d["kv_blocks_total"] = res.sched.blocks.total
            d.update(self.isolated_warmup())
            d["workspace_bytes"] = res.workspace.nbytes
            d["required_bytes"] = bound
            broken = [k for k in ("slots_restored", "live_kv_unchanged", "eplb_unchanged") if not d[k]]
            flag = torch.tensor([1 if broken else 0], dtype=torch.int64)
            group = self.shared.group
            anyone = bool(group.all_reduce_max(flag)[0]) if group is not None else bool(broken)
            if anyone and not faults.active("no_warmup_check"):
                where = (
                    (f"{', '.join(broken)} false; live KV checksum {d['live_kv_checksum']} -> {d['live_kv_after']}")
                    if broken
                    else "on another rank of the group"
                )
                raise WarmupIsolationError(f"warm-up touched serving state ({where})")
            return dict(d)

    def _capture_pass(self, op_id: str) -> None:
        """One capture pass over every capture size."""
        res, telemetry, reuse = self.res, self.telemetry, self.reuse
        telemetry.set_state(RankState.CAPTURING)
        if op_id != "startup":
            res.faults.hold("capture")
        res.graphs.begin_pass()
        with telemetry.phase(op_id, "capture") as d, reuse.detached() if reuse else nullcontext():
            t0 = time.perf_counter()
            for size in res.cfg.capture_sizes:
                self.capture(size)
            d["sizes"] = list(res.cfg.capture_sizes)
            d["per_size_s"] = {str(k): round(v, 6) for k, v in res.graphs.stats.capture_durations.items()}
            d["total_s"] = time.perf_counter() - t0
            d["graphs_this_op"] = res.graphs.stats.captures_this_op
            d["graph_kind"] = res.graphs.kind

    def _join_under_reuse(self, op_id: str, reuse: CaptureReuse) -> dict[str, Any]:
        """A joiner under reuse: size for the capacity, capture once with collectives detached."""
        res, telemetry = self.res, self.telemetry
        reuse.size_at_start()
        bound = res.model.moe_workspace_bound(reuse.capacity)
        telemetry.set_state(RankState.WARMING)
        with telemetry.phase(op_id, "warm", capture_policy="reuse") as d:
            self._resize(bound)
            d.update(workspace_bytes=res.workspace.nbytes, required_bytes=bound, kv_blocks_total=res.sched.blocks.total)
        telemetry.set_state(RankState.CAPTURING)
        res.graphs.begin_pass()
        with telemetry.phase(op_id, "capture", capture_policy="reuse") as d, reuse.detached():
            t0 = time.perf_counter()
            for size in res.cfg.capture_sizes:
                self.capture(size)
            d.update(sizes=list(res.cfg.capture_sizes), total_s=time.perf_counter() - t0, graph_kind=res.graphs.kind)
        self.shared.capture_passes = res.graphs.passes_this_op
        with telemetry.phase(
            op_id,
            "lock",
            capture_passes=res.graphs.passes_this_op,
            expected_passes=1,
            capture_policy="reuse",
            required_bytes=bound,
        ) as d:
            d["workspace_bytes"] = res.workspace.nbytes
            res.workspace.lock(bound)
            d["reused_sizes"] = reuse.verify()
        return {
            "captures_this_op": res.graphs.passes_this_op,
            "capture_policy": "reuse",
            "workspace_after": res.workspace.nbytes,
            "kv_blocks_after": res.sched.blocks.total,
        }

    def capture_in_pool(self) -> dict[str, Any] | None:
        """A standby under reuse: size the workspace for the capacity, warm up and take its one
        capture pass (collectives detached) while in the pool, since none of it needs a group.
        The captures read the EP position as a device scalar (``MoEModel.position``), so adoption
        re-points them; the commit that adopts the rank only checks them. None (nothing done)
        under recapture or without a capture world (the launch world is known only at adoption)."""
        reuse, res = self.reuse, self.res
        if reuse is None or reuse.capacity <= 0:
            return None
        graphs = res.graphs
        t0 = time.perf_counter()
        bound = res.model.moe_workspace_bound(reuse.capacity)
        self._resize(bound)
        warm = self.isolated_warmup()  # no group: a one-rank batch through the real path
        t1 = time.perf_counter()
        graphs.begin_operation(POOL_OP)
        graphs.begin_pass()
        with reuse.detached():
            for size in res.cfg.capture_sizes:
                self.capture(size)
        t2 = time.perf_counter()
        res.workspace.lock(bound)
        self.pool = {
            "warm_s": round(t1 - t0, 6),
            "capture_s": round(t2 - t1, 6),
            "sizes": list(res.cfg.capture_sizes),
            "per_size_s": {str(k): round(v, 6) for k, v in graphs.stats.capture_durations.items()},
            "graph_kind": graphs.kind,
            "warmup_tokens": warm["warmup_tokens"],
            "at": time.time(),
        }
        return self.pool

    def _join_with_pool_capture(self, op_id: str, reuse: CaptureReuse) -> dict[str, Any]:
        """A joiner adopted from the pool under reuse: its pass was taken in the pool and is
        reported here as this operation's one pass (I4), marked ``in_pool``; the lock re-checks
        every capture against the live world, buffers and workspace (the staleness check)."""
        res, telemetry, pool = self.res, self.telemetry, self.pool
        assert pool is not None
        self.pool = None  # a later transition finds a survivor's kept captures
        bound = res.model.moe_workspace_bound(reuse.capacity)
        telemetry.set_state(RankState.CAPTURING)
        res.graphs.credit_pool_pass()
        with telemetry.phase(op_id, "capture", capture_policy="reuse", in_pool=True) as d:
            d.update(
                sizes=pool["sizes"],
                total_s=0.0,
                pool_capture_s=pool["capture_s"],
                pool_warm_s=pool["warm_s"],
                per_size_s=pool["per_size_s"],
                graph_kind=pool["graph_kind"],
            )
        self.shared.capture_passes = res.graphs.passes_this_op
        with telemetry.phase(
            op_id,
            "lock",
            capture_passes=res.graphs.passes_this_op,
            expected_passes=1,
            capture_policy="reuse",
            required_bytes=bound,
            capture_in_pool=True,
        ) as d:
            d["workspace_bytes"] = res.workspace.nbytes
            res.workspace.lock(bound)
            d["reused_sizes"] = reuse.verify()
        return {
            "captures_this_op": res.graphs.passes_this_op,
            "capture_policy": "reuse",
            "capture_in_pool": True,
            "pool_capture_s": pool["capture_s"],
            "workspace_after": res.workspace.nbytes,
            "kv_blocks_after": res.sched.blocks.total,
        }

    def isolated_warmup(self) -> dict[str, Any]:
        """A max_num_tokens batch through the real slot, block-table and KV path, touching no
        serving state (I5): only slots free on every rank, their rows pointing at the null block,
        and no EPLB load recorded."""
        res, group = self.res, self.shared.group
        cfg, sched, model = res.cfg, res.sched, res.model
        broken = res.faults.active("warmup_not_isolated")
        record_load = res.faults.active("eplb_not_suppressed")
        slots_before = self._live_slot_state()
        kv_before = self.live_kv_checksum()
        eplb_before = res.eplb.snapshot()
        load_before = model.expert_load.clone()
        # The synthetic batch may use only slots that are free on every rank.
        free = torch.tensor([-sched.slots.free], dtype=torch.int64)
        min_free = -int(group.all_reduce_max(free)[0]) if group else sched.slots.free
        n = cfg.max_num_tokens
        live = sched.live_blocks()
        if broken:
            # Takes every slot, live or not, and points its row at live blocks (upstream's dummy
            # run sharing the serving request state): live requests then read the dummy's KV.
            taken = list(range(cfg.max_num_seqs))
            for i, s in enumerate(taken):
                model.set_slot_blocks(
                    s, [live[(i + j) % len(live)] for j in range(cfg.max_blocks_per_seq)] if live else []
                )
        else:
            taken = [sched.slots.allocate() for _ in range(max(0, min(min_free, cfg.max_num_seqs)))]
            for s in taken:
                model.set_slot_blocks(s, [NULL_BLOCK] * cfg.max_blocks_per_seq)
        dev = res.device
        per = max(1, -(-n // max(1, len(taken))))
        req_slots = [taken[i // per] if taken else model.null_slot for i in range(n)]
        positions = [i % per for i in range(n)]
        g = torch.Generator().manual_seed(1234 + self.shared.rank)
        batch = Batch(
            torch.randint(0, cfg.vocab_size, (n,), generator=g).to(dev),
            torch.tensor(positions, device=dev),
            torch.tensor(req_slots, dtype=torch.int64, device=dev),
            torch.ones(n, dtype=torch.bool, device=dev),
        )
        try:
            model.forward(batch, group, res.workspace, record_load=record_load)
        finally:  # a warm-up that fails (a peer lost, an overflow) must not keep the slots it took
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
            "eplb_unchanged": res.eplb.snapshot() == eplb_before and torch.equal(model.expert_load, load_before),
            "live_kv_checksum": kv_before,
            "live_kv_after": kv_after,
        }

    def capture(self, size: int) -> None:
        """Capture the decode step for ``size`` sequences against static input buffers; the plan
        binds its tensors now, so replays read exactly these."""
        res = self.res
        cfg, dev, model = res.cfg, res.device, res.model
        inputs = {
            "token_ids": torch.zeros(size, dtype=torch.int64, device=dev),
            "positions": torch.zeros(size, dtype=torch.int64, device=dev),
            # The null slot, so the capture run itself writes only the null block.
            "req_slots": torch.full((size,), model.null_slot, dtype=torch.int64, device=dev),
            "valid": torch.zeros(size, dtype=torch.bool, device=dev),
        }
        output = torch.zeros(size, cfg.vocab_size, dtype=model.dtype, device=dev)
        batch = Batch(inputs["token_ids"], inputs["positions"], inputs["req_slots"], inputs["valid"])
        group = self.shared.group if self.reuse is None else self.reuse.handle  # reuse: sized for max DP
        # CUDA: the gathered, shape-static MoE path (a routed exchange's sizes follow the routing,
        # which a graph cannot); CPU replays run Python and take the routed path.
        steps, ns = model.plan(
            batch,
            group,
            res.workspace,
            dense_moe=dev.type == "cuda",  # type: ignore[arg-type]
            bind_workspace=True,
        )
        steps = [*steps, ("compute", lambda: output.copy_(ns["logits"]))]
        res.graphs.capture(size, inputs, output, steps)
