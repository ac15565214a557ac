"""Warm-up and capture: release graphs, size the workspace for the new world, run an
isolated warm-up batch, capture once, lock the workspace (invariants I3, I4, I5, I7)."""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

import torch

from engine_ext.engine.model import Batch
from engine_ext.engine.scheduler import NULL_BLOCK
from engine_ext.protocol import RankState

if TYPE_CHECKING:
    from engine_ext.engine.rank import RankEngine


class Warmup:
    """Warm-up and capture of one rank, run in lockstep on every rank of its group."""

    def __init__(self, engine: RankEngine) -> None:
        self.engine = engine

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

    def warm_and_capture(self, op_id: str) -> dict[str, Any]:
        """Release graphs -> unlock -> size for the bound -> isolated warm-up -> capture once -> lock."""
        e = self.engine
        faults = e.faults
        report: dict[str, Any] = {"workspace_before": e.workspace.nbytes}
        if not faults.active("skip_release"):
            report["graphs_released"] = e.graphs.release()
        e.telemetry.set_state(RankState.WARMING)
        faults.hold("warm")
        with e.telemetry.phase(op_id, "warm") as d:
            e.workspace.unlock()
            bound = e.model.moe_workspace_bound(e.world_size)
            e.required_workspace = bound
            d["graphs_live_at_resize"] = len(e.graphs.captured_sizes)  # I3: must be 0
            if not faults.active("skip_rewarm"):
                e.workspace.reserve(bound)
            d.update(self.isolated_warmup())
            d["workspace_bytes"] = e.workspace.nbytes
            d["required_bytes"] = bound
            report.update(d)
        # "skip_release" keeps the old captures (none are made where none were released);
        # "double_capture" reproduces upstream before its fix: the re-warm captured a second time.
        if faults.active("skip_release") and op_id != "startup":  # every rank alike: captures are collective
            passes = 0
        else:
            passes = 2 if faults.active("double_capture") else 1
        for _ in range(passes):
            e.telemetry.set_state(RankState.CAPTURING)
            faults.hold("capture")
            with e.telemetry.phase(op_id, "capture") as d:
                t0 = time.perf_counter()
                for size in e.cfg.capture_sizes:
                    self.capture(size)
                d["sizes"] = list(e.cfg.capture_sizes)
                d["per_size_s"] = {str(k): round(v, 6) for k, v in e.graphs.stats.capture_durations.items()}
                d["total_s"] = time.perf_counter() - t0
                d["graphs_this_op"] = e.graphs.stats.captures_this_op
                d["graph_kind"] = e.graphs.kind
            e.capture_passes += 1
        e.workspace.lock()
        report["workspace_after"] = e.workspace.nbytes
        report["captures_this_op"] = e.capture_passes
        return report

    def isolated_warmup(self) -> dict[str, Any]:
        """A max_num_tokens batch through the real slot and KV path, touching no serving state (I5)."""
        e = self.engine
        cfg, sched = e.cfg, e.sched
        broken = e.faults.active("warmup_not_isolated")
        slots_before = sched.slots.snapshot()
        kv_before = self.live_kv_checksum()
        eplb_before = e.eplb.snapshot()
        # The synthetic batch may use only slots that are free on every rank.
        free = torch.tensor([-sched.slots.free], dtype=torch.int64)
        min_free = -int(e.group.all_reduce_max(free)[0]) if e.group else sched.slots.free
        n_req = cfg.max_num_seqs if broken else max(0, min(min_free, cfg.max_num_seqs))
        if broken:
            # Takes slots without the cap and frees them out of order (upstream's "No free indices").
            taken = [sched.slots.allocate() for _ in range(min(n_req, sched.slots.free))]
        else:
            taken = [sched.slots.allocate() for _ in range(n_req)]
        n = cfg.max_num_tokens
        live = sched.live_blocks()
        if broken and live:  # writes the dummy KV into live blocks
            slot_map = [live[i % len(live)] * cfg.block_size + (i % cfg.block_size) for i in range(n)]
        else:
            slot_map = [NULL_BLOCK * cfg.block_size] * n
        dev = e.device
        maxb = cfg.max_blocks_per_seq
        per = max(1, -(-n // max(1, len(taken))))
        positions = [i % per for i in range(n)]
        g = torch.Generator().manual_seed(1234 + e.rank)
        batch = Batch(torch.randint(0, cfg.vocab_size, (n,), generator=g).to(dev),
                      torch.tensor(positions, device=dev), torch.tensor(slot_map, device=dev),
                      torch.zeros(n, maxb, dtype=torch.int64, device=dev),
                      torch.full((n,), broken, dtype=torch.bool, device=dev))
        counts = torch.zeros(cfg.num_experts, dtype=torch.int64, device=dev)
        if not broken:
            e.eplb.suppressed += 1
        try:
            e.model.forward(batch, e.group, e.workspace, expert_counts=counts)
        finally:
            if not broken:
                e.eplb.suppressed -= 1
        if broken:  # the broken variant lets the dummy batch count as load
            e.eplb.record(counts.tolist())
        for s in (taken if broken else reversed(taken)):
            sched.slots.release(s)
        return {
            "warmup_requests": len(taken),
            "warmup_tokens": n,
            "min_free_slots": min_free,
            "slots_restored": sched.slots.snapshot() == slots_before,
            "live_kv_unchanged": self.live_kv_checksum() == kv_before,
            "eplb_unchanged": e.eplb.snapshot() == eplb_before,
            "live_kv_checksum": kv_before,
        }

    def capture(self, size: int) -> None:
        """Capture the decode step for ``size`` sequences against static input buffers."""
        e = self.engine
        cfg, dev = e.cfg, e.device
        maxb = cfg.max_blocks_per_seq
        inputs = {
            "token_ids": torch.zeros(size, dtype=torch.int64, device=dev),
            "positions": torch.zeros(size, dtype=torch.int64, device=dev),
            "slot_mapping": torch.zeros(size, dtype=torch.int64, device=dev),
            "block_tables": torch.zeros(size, maxb, dtype=torch.int64, device=dev),
            "valid": torch.zeros(size, dtype=torch.bool, device=dev),
            "expert_counts": torch.zeros(cfg.num_experts, dtype=torch.int64, device=dev),
        }
        output = torch.zeros(size, cfg.vocab_size, dtype=e.model.dtype, device=dev)
        batch = Batch(inputs["token_ids"], inputs["positions"], inputs["slot_mapping"],
                      inputs["block_tables"], inputs["valid"])
        steps, ns = e.model.plan(batch, e.group, e.workspace, dense_moe=True, expert_counts=inputs["expert_counts"])
        steps = [("compute", inputs["expert_counts"].zero_), *steps,
                 ("compute", lambda: output.copy_(ns["logits"]))]
        e.eplb.suppressed += 1
        try:
            e.graphs.capture(size, inputs, output, steps)
        finally:
            e.eplb.suppressed -= 1
