"""A vLLM rank's record as status shows it: its engine core's report with its worker's merged in.

vLLM runs a DP rank in two places: the engine core (requests, KV, identity, live DP rank) and its
worker (the model: workspace, warm-up and capture passes, the elastic steps). Each reports itself
to the registry (engine_ext.vllm.reporter, engine_ext.vllm.worker_reporter), whatever executor
started the worker; the registry keeps both and merges them here, the worker's fields winning for
what only the worker sees. Ray-free and torch-free.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine_ext.protocol import STALE_AFTER_S
from engine_ext.records import RankStatus, VllmRankStatus, VllmWorkerStatus

# What only the worker knows; the engine core's own values are defaults.
WORKER_FIELDS = (
    "workspace_available",
    "workspace_bytes",
    "workspace_locked",
    "workspace_note",
    "graph_kind",
    "graphs_captured",
    "capture_sizes",
    "capture_sizes_expected",
    "capture_times_s",
    "last_capture_pass_s",
    "captures_total",
    "captures_this_op",
    "warmups_total",
    "warmups_this_op",
    "last_warmup_s",
    "current_op",
    "last_op",
    "op_phase_s",
    "hook_calls",
    "hooks",
)
# A worker started before its engine core belongs to an earlier process holding that rank number
# (vLLM gives a rejoining rank the same identity); the worker starts after its engine core.
STARTED_SLACK_S = 1.0


def belongs(core: RankStatus, worker: VllmWorkerStatus | None) -> bool:
    """Whether ``worker`` is the worker of this incarnation of ``core``'s rank."""
    if worker is None or not isinstance(core, VllmRankStatus):
        return False
    return worker.rank == core.rank and worker.started >= core.started - STARTED_SLACK_S


def merge(core: RankStatus, worker: VllmWorkerStatus | None, worker_age_s: float) -> RankStatus:
    """``core`` with its worker's record merged in (unchanged when the worker is not its own). The
    worker's step state (e.g. ``warming`` inside a transition) shows while it is fresh."""
    if not belongs(core, worker):
        return core
    assert worker is not None
    changes: dict[str, Any] = {name: getattr(worker, name) for name in WORKER_FIELDS}
    changes.update(
        worker_pid=worker.pid,
        worker_executor=worker.executor,
        worker_age_s=round(worker_age_s, 2),
        last_capture_s=worker.last_capture_pass_s,
        worker_rss_bytes=worker.rss_bytes,
        memory_bytes=held_bytes(core, worker),
    )
    if worker.device:
        changes["device"] = worker.device
    if worker.state and worker_age_s <= STALE_AFTER_S:
        changes["state"] = worker.state
    return msgspec.structs.replace(core, **changes)


def held_bytes(core: RankStatus, worker: VllmWorkerStatus) -> int | None:
    """What the rank's processes hold resident: its engine core's and, where the worker runs in a
    process of its own (``mp``, ``ray``), the worker's; None where neither says."""
    if worker.pid == core.pid:  # ``uni``: the worker runs in the engine core's process
        return core.rss_bytes if core.rss_bytes is not None else worker.rss_bytes
    known = [b for b in (core.rss_bytes, worker.rss_bytes) if b is not None]
    return sum(known) if known else None
