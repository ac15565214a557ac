"""The ``reuse`` capture policy: captures sized once for the largest world, kept across transitions.

Under ``recapture`` (the default) every transition releases the captured decode steps, right-sizes
the MoE workspace for the new world and captures once more (I3, I4). Under ``reuse`` the workspace
and every capture are sized at start for ``capture_world`` (the deployment's max DP): a capture
reads and writes its collectives through a ``MaxWorldGroup``, which forwards them to whatever DP
group is live and pads the rows of absent ranks with zeros, so a transition only switches groups
and layouts. Survivors capture nothing; a joiner captures once, locally, with the collectives
detached (the capture run's output is never read): in the standby pool before its adoption
when it comes from one (``Warmup.capture_in_pool``), else in its commit. A capture reads the EP
position as a device scalar (``MoEModel.position``), so a rank whose position changes keeps it.
The cost is memory: the workspace at ``capture_world`` instead of at the current world
(``engine_ext.capture_memory``).

The graph manager's staleness check stays on: a capture remembers ``(handle, world)`` where the
world is ``capture_world`` while the live world fits in it, and the live size once it does not,
so a capture sized for a smaller world (the ``reuse_sized_for_world`` fault) is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from engine_ext.rank.shared import RankResources, RankShared
from engine_ext.rank.telemetry import RankTelemetry

if TYPE_CHECKING:
    from engine_ext.config import EngineConfig
    from engine_ext.elastic.comm import StatelessGroup
    from engine_ext.faults import Faults


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

    @property
    def reduce_scatters_on_device(self) -> bool:
        """The live group's answer (read at every call: a transition may change the transport);
        detached, a reduce-scatter is a local copy."""
        g = self._group()
        return True if g is None else g.reduce_scatters_on_device

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

    def all_gather_many(self, items: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
        """The live group's one exchange of several all-gathers (shared memory), the rest zeroed."""
        g = self._group()
        if g is None:
            for outs, inp in items:
                self.all_gather(outs, inp)
            return
        g.all_gather_many([(outs[: g.size], inp) for outs, inp in items])
        for outs, _ in items:
            for t in outs[g.size :]:
                t.zero_()

    def all_to_all_v(
        self,
        send: torch.Tensor,
        send_counts: list[int],
        recv_alloc: Callable[[int], torch.Tensor],
        recv_counts: list[int] | None = None,
    ) -> list[int]:
        """The live group's all-to-all (absent ranks send and receive nothing); detached, only
        the rows this rank routes to itself, as if alone."""
        g = self._group()
        if g is None:
            me = min(self.rank, len(send_counts) - 1)
            start, n = sum(send_counts[:me]), send_counts[me]
            recv_alloc(n).copy_(send[start : start + n])
            return [n if j == me else 0 for j in range(len(send_counts))]
        got = g.all_to_all_v(
            send, send_counts[: g.size], recv_alloc, None if recv_counts is None else recv_counts[: g.size]
        )
        return got + [0] * (len(send_counts) - g.size)

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
    """One rank's side of the ``reuse`` policy: the max-world handle its captures use, and the
    check a survivor's kept captures pass in a transition (a joiner's capture is ``Warmup``'s)."""

    def __init__(self, handle: MaxWorldGroup, res: RankResources, shared: RankShared, telemetry: RankTelemetry) -> None:
        self.handle = handle
        self.res = res
        self.shared = shared
        self.telemetry = telemetry

    @property
    def capacity(self) -> int:
        return self.handle.capacity

    def size_at_start(self) -> None:
        """Without a capture world (or under the broken variant), size for the world at launch."""
        if self.handle.capacity <= 0:
            self.handle.capacity = self.shared.world_size

    @contextmanager
    def detached(self) -> Iterator[None]:
        self.handle.detached = True
        try:
            yield
        finally:
            self.handle.detached = False

    def verify(self) -> list[int]:
        """Every captured size may replay in the live world, else ReusedCaptureError (the check)."""
        world, graphs = self.shared.world_size, self.res.graphs
        if world > self.capacity:
            raise ReusedCaptureError(
                f"reused capture refused: its buffers are sized for a world of {self.capacity}, "
                f"the new world has {world} ranks (size captures for max DP under reuse)"
            )
        for size in graphs.captured_sizes:
            graphs.check(size)  # StaleGraphError if any buffer it reads moved
        return graphs.captured_sizes

    def transition(self, op_id: str) -> dict[str, Any]:
        """A survivor under reuse: nothing released, nothing captured; the lock re-checked. The
        passes it reports are the graph manager's count, where a capture pass would be counted."""
        workspace, graphs = self.res.workspace, self.res.graphs
        if self.res.faults.active("reuse_drops_captures"):
            graphs.release()  # the captures are not kept: the survivor serves its decodes eagerly
        with self.telemetry.phase(
            op_id,
            "lock",
            capture_passes=graphs.passes_this_op,
            expected_passes=0,
            capture_policy="reuse",
            required_bytes=workspace.nbytes,
        ) as d:
            d["reused_sizes"] = self.verify()
            d["workspace_bytes"] = workspace.nbytes
            d["capture_world"] = self.capacity
        self.shared.capture_passes = graphs.passes_this_op
        return {
            "captures_this_op": graphs.passes_this_op,
            "capture_policy": "reuse",
            "workspace_after": workspace.nbytes,
            "kv_blocks_after": self.res.sched.blocks.total,
        }


def max_world_handle(cfg: EngineConfig, faults: Faults, shared: RankShared) -> MaxWorldGroup | None:
    """The group handle captures use under ``capture_policy = reuse``, else None (recapture)."""
    if cfg.capture_policy != "reuse":
        return None
    # The capacity is max DP; without one (or under the broken variant, which forgets it), the
    # world at launch (``size_at_start``).
    capacity = 0 if faults.active("reuse_sized_for_world") else cfg.capture_world
    return MaxWorldGroup(lambda: shared.group, capacity)
