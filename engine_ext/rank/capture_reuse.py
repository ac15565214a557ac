"""The ``reuse`` capture policy: captures sized once for the largest world, kept across transitions.

Under ``recapture`` (the default) every transition releases the captured decode steps, right-sizes
the MoE workspace for the new world and captures once more (I3, I4). Under ``reuse`` the workspace
and every capture are sized at start for ``capture_world`` (the deployment's max DP): a capture
reads and writes its collectives through a ``MaxWorldGroup``, which forwards them to whatever DP
group is live and pads the rows of absent ranks with zeros, so a transition only switches groups
and layouts. Survivors capture nothing; a joiner captures once, locally, with the collectives
detached (the capture run's output is never read). The cost is memory: the workspace at
``capture_world`` instead of at the current world (``engine_ext.capture_memory``).

The graph manager's staleness check stays on: a capture remembers ``(handle, world)`` where the
world is ``capture_world`` while the live world fits in it, and the live size once it does not,
so a capture sized for a smaller world (the ``reuse_sized_for_world`` fault) is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from engine_ext.protocol import RankState

if TYPE_CHECKING:
    from engine_ext.elastic.comm import StatelessGroup
    from engine_ext.rank.engine import RankEngine

CAPTURE_POLICIES = ("recapture", "reuse")


class ReusedCaptureError(RuntimeError):
    """A reused capture whose buffers were sized for another world than the live one."""


class MaxWorldGroup:
    """A DP group of ``capacity`` ranks as a capture sees it, backed by the live group.

    ``size`` is the capacity (the plan sizes its gathered buffers for it); collectives use only
    the first ``live.size`` chunks and zero the others, whose zero routing weights then add
    nothing in the experts. Detached (a joiner's local capture), collectives touch no peer.
    """

    def __init__(self, live: Callable[[], StatelessGroup | None], capacity: int) -> None:
        self._live = live
        self.capacity = capacity
        self.detached = False

    @property
    def size(self) -> int:
        return self.capacity

    @property
    def live_size(self) -> int:
        g = self._live()
        return 1 if g is None else g.size

    @property
    def rank(self) -> int:
        g = self._live()
        return 0 if g is None else g.rank

    @property
    def device(self) -> torch.device:
        g = self._live()
        return torch.device("cpu") if g is None else g.device

    def world_key(self) -> tuple[int, int]:
        """What a capture is bound to: constant while the live world fits in the capacity."""
        return id(self), max(self.capacity, self.live_size)

    def _group(self) -> StatelessGroup | None:
        g = self._live()
        if g is not None and g.size > self.capacity:
            raise ReusedCaptureError(f"capture sized for a world of {self.capacity} replayed in a world of {g.size}")
        return None if self.detached else g

    def all_gather(self, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
        g = self._group()
        n = 0 if g is None else g.size
        if g is not None:
            g.all_gather(outs[:n], inp)
        for t in outs[n:]:
            t.zero_()
        if g is None:  # detached: only this rank's own rows, as if alone
            outs[min(self.rank, len(outs) - 1)].copy_(inp)

    def reduce_scatter(self, out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        g = self._group()
        if g is None:
            out.copy_(inputs[0])
        else:
            g.reduce_scatter(out, inputs[: g.size])

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        g = self._group()
        return t if g is None else g.all_reduce_sum(t)


class CaptureReuse:
    """One rank's side of the ``reuse`` policy."""

    def __init__(self, engine: RankEngine, capacity: int) -> None:
        self.engine = engine
        self.handle = MaxWorldGroup(lambda: engine.group, capacity)
        engine.graphs.world_key = self.handle.world_key

    @property
    def capacity(self) -> int:
        return self.handle.capacity

    def size_at_start(self) -> None:
        """Without a capture world (or under the broken variant), size for the world at launch."""
        if self.handle.capacity <= 0:
            self.handle.capacity = self.engine.world_size

    @contextmanager
    def detached(self) -> Iterator[None]:
        self.handle.detached = True
        try:
            yield
        finally:
            self.handle.detached = False

    def verify(self) -> list[int]:
        """Every captured size may replay in the live world, else ReusedCaptureError (the check)."""
        e = self.engine
        if e.world_size > self.capacity:
            raise ReusedCaptureError(
                f"reused capture refused: its buffers are sized for a world of {self.capacity}, "
                f"the new world has {e.world_size} ranks (size captures for max DP under reuse)")
        for size in e.graphs.captured_sizes:
            e.graphs.check(size)  # StaleGraphError if any buffer it reads moved
        return e.graphs.captured_sizes

    def transition(self, op_id: str) -> dict[str, Any]:
        """A survivor under reuse: nothing released, nothing captured; the lock re-checked."""
        e = self.engine
        with e.telemetry.phase(op_id, "lock", capture_passes=0, expected_passes=0, capture_policy="reuse",
                               required_bytes=e.workspace.nbytes) as d:
            d["reused_sizes"] = self.verify()
            d["workspace_bytes"] = e.workspace.nbytes
            d["capture_world"] = self.capacity
        e.capture_passes = 0
        return {"captures_this_op": 0, "capture_policy": "reuse", "workspace_after": e.workspace.nbytes,
                "kv_blocks_after": e.sched.blocks.total}

    def join(self, op_id: str) -> dict[str, Any]:
        """A joiner under reuse: size for the capacity, capture once with collectives detached."""
        e = self.engine
        self.size_at_start()
        bound = e.model.moe_workspace_bound(self.capacity)
        e.telemetry.set_state(RankState.WARMING)
        with e.telemetry.phase(op_id, "warm", capture_policy="reuse") as d:
            e.workspace.unlock()
            e.required_workspace = bound
            e.workspace.reserve(bound)
            with e.lock:
                e.sched.blocks.resize(e.warmup.kv_pool_blocks(e.workspace.nbytes))
            d.update(workspace_bytes=e.workspace.nbytes, required_bytes=bound, kv_blocks_total=e.sched.blocks.total)
        e.telemetry.set_state(RankState.CAPTURING)
        e.graphs.begin_pass()
        with e.telemetry.phase(op_id, "capture", capture_policy="reuse") as d, self.detached():
            t0 = time.perf_counter()
            for size in e.cfg.capture_sizes:
                e.warmup.capture(size)
            d.update(sizes=list(e.cfg.capture_sizes), total_s=time.perf_counter() - t0, graph_kind=e.graphs.kind)
        e.capture_passes = e.graphs.passes_this_op
        with e.telemetry.phase(op_id, "lock", capture_passes=e.graphs.passes_this_op, expected_passes=1,
                               capture_policy="reuse", required_bytes=bound) as d:
            d["workspace_bytes"] = e.workspace.nbytes
            e.workspace.lock(bound)
            d["reused_sizes"] = self.verify()
        return {"captures_this_op": e.graphs.passes_this_op, "capture_policy": "reuse",
                "workspace_after": e.workspace.nbytes, "kv_blocks_after": e.sched.blocks.total}


def reuse_for(engine: RankEngine) -> CaptureReuse | None:
    """The rank's reuse state under ``capture_policy = reuse``, else None (recapture)."""
    cfg = engine.cfg
    if cfg.capture_policy not in CAPTURE_POLICIES:
        raise ValueError(f"capture_policy must be one of {CAPTURE_POLICIES}, not {cfg.capture_policy!r}")
    if cfg.capture_policy != "reuse":
        return None
    # The broken variant sizes for the world at launch, as if max DP had been forgotten.
    capacity = 0 if engine.faults.active("reuse_sized_for_world") else cfg.capture_world
    return CaptureReuse(engine, capacity)
