"""The one interface through which a controller drives a rank.

``RankControl`` lists the methods a controller may call on a rank (``RankEngine`` implements
it); ``RANK_METHODS``, the allow-list the transports check, is derived from it. ``RankClient``
is its awaitable, typed mirror: each method forwards to one transport method, ``_invoke``,
implemented by ``RayRankClient`` (actor calls) and ``ProcessRankClient`` (a pipe). Torch-free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from engine_ext.elastic.rendezvous import Rendezvous
from engine_ext.elastic.transition_plan import TransitionPlan


class RankControl(Protocol):
    """What a controller may call on a rank (run in the rank's process, blocking)."""

    def host_store(self) -> tuple[str, int]:
        """Host the deployment's TCPStore (rank 0) and return its address."""

    def join(self, rdzv: Rendezvous, world_size: int, timeout_s: float = 120.0) -> None:
        """Form the DP/EP group of a starting deployment."""

    def warm_and_capture(self, op_id: str) -> dict[str, Any]:
        """Release, size the workspace, isolated warm-up, capture once, lock."""

    def serve(self) -> None:
        """Start the step loop."""

    def add_request(self, wire: dict[str, Any]) -> None:
        """Queue a request; raises when the rank takes no requests."""

    def give_back_waiting(self, keep: int) -> list[dict[str, Any]]:
        """Hand back the requests waiting (not yet prefilled) beyond the first ``keep``."""

    def status(self) -> dict[str, Any]:
        """The rank's status record."""

    def prepare(self, plan: TransitionPlan) -> dict[str, Any]:
        """Form standby groups and the EPLB communicator; move non-expert weights."""

    def begin_drain(self, op_id: str) -> None:
        """Mark a removing rank draining while its requests finish."""

    def request_commit(self, op_id: str) -> None:
        """Ask the step loop to commit the prepared operation at the next agreed step."""

    def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        """Wait for this rank's commit and return its result."""

    def abort(self, op_id: str) -> bool:
        """Roll back a prepared, uncommitted operation."""

    def recover(self, plan: TransitionPlan) -> dict[str, Any]:
        """A peer died: abort the old groups, rebuild the survivors' world, serve again."""

    def stop(self) -> None:
        """Stop serving and leave the group."""

    def fence(self, epoch: int, reason: str) -> None:
        """The world moved on without this rank at ``epoch``: serve nothing more."""

    def adopt(self, rank: int, layout_d: dict[str, Any]) -> None:
        """A standby rank becomes DP rank ``rank`` (engine_ext.rank.standby)."""

    def recent_events(self) -> list[dict[str, Any]]:
        """The rank's recent phase events."""


RANK_METHODS: frozenset[str] = frozenset(
    name for name, value in vars(RankControl).items() if callable(value) and not name.startswith("_")
)


class MissingRank(Exception):
    """A member whose process was gone when a restarted controller re-attached to its world."""


class RankClient(ABC):
    """A controller's handle on one rank: ``RankControl``'s methods, awaitable, with a timeout."""

    rank: int

    @abstractmethod
    async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
        """Run ``method`` (one of RANK_METHODS) on the rank."""

    @abstractmethod
    async def kill(self) -> None:
        """End the rank's process at once."""

    @abstractmethod
    def pid(self) -> int: ...

    async def host_store(self, *, timeout: float | None = None) -> tuple[str, int]:
        host, port = await self._invoke("host_store", timeout=timeout)
        return host, int(port)

    async def join(
        self, rdzv: Rendezvous, world_size: int, timeout_s: float = 120.0, *, timeout: float | None = None
    ) -> None:
        await self._invoke("join", rdzv, world_size, timeout_s, timeout=timeout)

    async def warm_and_capture(self, op_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._invoke("warm_and_capture", op_id, timeout=timeout)

    async def serve(self, *, timeout: float | None = None) -> None:
        await self._invoke("serve", timeout=timeout)

    async def add_request(self, wire: dict[str, Any], *, timeout: float | None = None) -> None:
        await self._invoke("add_request", wire, timeout=timeout)

    async def give_back_waiting(self, keep: int, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return await self._invoke("give_back_waiting", keep, timeout=timeout)

    async def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._invoke("status", timeout=timeout)

    async def adopt(self, rank: int, layout_d: dict[str, Any], *, timeout: float | None = None) -> None:
        await self._invoke("adopt", rank, layout_d, timeout=timeout)

    async def prepare(self, plan: TransitionPlan, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._invoke("prepare", plan, timeout=timeout)

    async def begin_drain(self, op_id: str, *, timeout: float | None = None) -> None:
        await self._invoke("begin_drain", op_id, timeout=timeout)

    async def request_commit(self, op_id: str, *, timeout: float | None = None) -> None:
        await self._invoke("request_commit", op_id, timeout=timeout)

    async def wait_op(self, op_id: str, timeout_s: float, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._invoke("wait_op", op_id, timeout_s, timeout=timeout)

    async def abort(self, op_id: str, *, timeout: float | None = None) -> bool:
        return bool(await self._invoke("abort", op_id, timeout=timeout))

    async def recover(self, plan: TransitionPlan, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._invoke("recover", plan, timeout=timeout)

    async def stop(self, *, timeout: float | None = None) -> None:
        await self._invoke("stop", timeout=timeout)

    async def fence(self, epoch: int, reason: str, *, timeout: float | None = None) -> None:
        await self._invoke("fence", epoch, reason, timeout=timeout)

    async def recent_events(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return await self._invoke("recent_events", timeout=timeout)

    async def ping(self, *, timeout: float | None = None) -> None:
        """A second probe of the rank's liveness, made only to confirm a silence before a fence
        (engine_ext.control.suspicion): here one more status call with its own timeout; a
        transport with a path that bypasses the engine (the Ray actor's own method) uses it."""
        await self._invoke("status", timeout=timeout)


class GoneRankClient(RankClient):
    """A member a restarted controller could not find: every call fails (the recovery then runs
    without it) and there is no process to end."""

    def __init__(self, rank: int, why: str) -> None:
        self.rank = rank
        self.why = why

    async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
        raise MissingRank(f"rank {self.rank} is gone: {self.why}")

    async def kill(self) -> None:
        return None

    def pid(self) -> int:
        return -1
