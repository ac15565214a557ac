"""A deployment's live world: its ranks in position order, their clients, the expert layout, the
store, the router in front of them and the single-flight lock (I9).

``World`` is the one owner of that state. The orchestrator (start, scale, stop) and the
recovery (a rank died) both change it, and only through these methods:

* ``adopt`` — a transition or recovery committed: the new members, their clients, layout and
  epoch, handed to the router in one step. Nothing else writes ``members``, ``clients`` or
  ``layout`` after start (``stop`` empties ``clients``).
* ``fence`` / ``accepts`` — a rank excluded by epoch (it hung, failed or was cut off): nothing it
  sends from that epoch or an older one is taken (tokens, results, reports).
* ``move_store`` — the store's host died: a survivor hosts the new one (recovery only).
* ``rendezvous`` — a fresh rendezvous on the store for the next group (one epoch each).
* ``call_all`` — one control call on every rank of a world, failing on the first error.
* ``record`` / ``phase_done`` — the operation record and its phase events, as the registry
  and ``eepctl events`` show them.
* ``router`` — its public methods (exclude, pause, reroute, resume, fail) are how either side
  keeps requests away from a rank that is leaving or dead.
* ``op_lock`` — held by whoever runs an operation (a scale or a recovery), never by both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from engine_ext.control.rank_client import RankClient
from engine_ext.control.router import Router
from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.rendezvous import Rendezvous
from engine_ext.protocol import Event, Operation, OpState, to_builtins

EventSink = Callable[[dict[str, Any]], None]
RankCall = Callable[[RankClient], Awaitable[Any]]


class RankCallFailed(Exception):
    """A control call failed on a rank of the world (the first failure, in rank order)."""

    def __init__(self, rank: int, method: str, error: BaseException, errors: dict[int, BaseException]) -> None:
        super().__init__(f"rank {rank} failed in {method}: {error}")
        self.rank, self.method, self.error, self.errors = rank, method, error, errors


class World:
    """The ranks one deployment serves with, and the operation that changes them."""

    def __init__(
        self,
        name: str,
        *,
        emit: EventSink | None = None,
        record_op: Callable[[dict[str, Any]], Any] | None = None,
        forget_rank: Callable[[int], Any] | None = None,
    ) -> None:
        self.name = name
        # Global ranks (identities) in position order. A rank keeps its number while it lives;
        # a number freed by a scale-down or a death is given to the next joiner (its actor is gone).
        self.members: list[int] = []
        self.clients: dict[int, RankClient] = {}
        self.layout: ExpertLayout | None = None
        self.store: tuple[str, int] | None = None
        self.store_host = 0  # the member whose process hosts the store
        self.epoch = 0  # one per rendezvous: group names are never reused
        self.serving_epoch = 0  # the epoch of the committed world (its members serve in it)
        self.fenced: dict[int, dict[str, Any]] = {}  # rank -> {epoch, reason, at}: never heard from again
        self.router = Router()
        self.op: Operation | None = None  # the newest operation (scale or recover)
        self.op_lock = asyncio.Lock()
        self.history: list[dict[str, Any]] = []
        self.stopping = False
        self.emit = emit or (lambda e: None)
        self.record_op = record_op or (lambda op: None)
        self.forget_rank = forget_rank or (lambda rank: None)

    @property
    def size(self) -> int:
        return len(self.clients)

    # ---- membership ----------------------------------------------------------------------------
    def adopt(self, clients: dict[int, RankClient], layout: ExpertLayout, epoch: int) -> None:
        """The committed world of ``epoch``: ``clients`` in position order become the members."""
        self.clients = dict(clients)
        self.members = list(clients)
        self.layout = layout
        self.serving_epoch = max(self.serving_epoch, epoch)
        self.router.set_ranks(self.clients)

    def fence(self, rank: int, reason: str) -> int:
        """Exclude ``rank`` by epoch: what it sends from the serving epoch or an older one is
        ignored from now on (a new rank given its number later joins a newer epoch)."""
        self.fenced[rank] = {"rank": rank, "epoch": self.serving_epoch, "reason": reason, "at": time.time()}
        return self.serving_epoch

    def accepts(self, rank: int, epoch: int) -> bool:
        """Whether a message of ``rank`` produced in ``epoch`` may count (not from a fenced world)."""
        fenced = self.fenced.get(rank)
        return fenced is None or epoch > fenced["epoch"]

    def move_store(self, store: tuple[str, int], host: int) -> None:
        self.store, self.store_host = store, host

    def rendezvous(self, tag: str) -> Rendezvous:
        assert self.store is not None
        self.epoch += 1
        return Rendezvous(self.store[0], self.store[1], f"{self.name}/e{self.epoch}-{tag}", self.epoch)

    @staticmethod
    async def call_all(clients: dict[int, RankClient], method: str, call: RankCall) -> dict[int, Any]:
        """``call`` every rank; fail on the first error instead of waiting for the others (a dead
        joiner must not keep the survivors' rollback waiting for a rendezvous timeout)."""
        tasks = {asyncio.ensure_future(call(clients[r])): r for r in sorted(clients)}
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                for t in pending:
                    t.cancel()
                first = min(failed, key=lambda t: tasks[t])
                raise RankCallFailed(
                    tasks[first],
                    method,
                    first.exception(),  # type: ignore[arg-type]
                    {tasks[t]: t.exception() for t in failed},
                )  # type: ignore[misc]
        return {r: t.result() for t, r in tasks.items()}

    # ---- operations ----------------------------------------------------------------------------
    def busy(self) -> str | None:
        """The operation holding the single-flight lock, if any (I9)."""
        running = self.running_op()
        if running is not None:
            return f"{running.op_id} (DP {running.from_size}->{running.to_size})"
        return "an operation being planned" if self.op_lock.locked() else None

    def running_op(self) -> Operation | None:
        return self.op if self.op is not None and self.op.state == OpState.RUNNING.value else None

    def record(self, op: Operation) -> None:
        """Keep the operation's newest record (last 100) and hand it to the registry."""
        d = to_builtins(op)
        if not self.history or self.history[-1]["op_id"] != op.op_id:
            self.history.append(d)
        else:
            self.history[-1] = d
        self.history = self.history[-100:]
        self.record_op(d)

    def enter_phase(self, op: Operation, phase: str) -> None:
        """``op`` enters ``phase``: recorded at once, so a restarted controller knows where it was."""
        op.phase = phase
        self.record(op)

    def phase_done(self, op: Operation, phase: str, start: float, end: float | None = None, **detail: Any) -> None:
        """A phase of ``op`` ended: add its time, emit its event, record the operation."""
        end = time.time() if end is None else end
        op.phase_durations[phase] = round(op.phase_durations.get(phase, 0.0) + end - start, 6)
        self.emit(to_builtins(Event(op.op_id, -1, phase, start, end, "ok", detail)))
        self.record(op)

    async def stop(self) -> None:
        """Stop every rank, then end its process; deaths reported from now on are expected."""
        self.stopping = True
        self.router.closed = True
        self.router.fail_parked("the deployment is stopping")
        for c in self.clients.values():
            await quiet(c.stop(timeout=5))
        for c in self.clients.values():
            await quiet(c.kill())
        self.clients = {}

    async def rank_states(self) -> dict[str, str]:
        """Each member's state as it answers (``unreachable`` when it does not)."""
        states: dict[str, str] = {}
        for r, c in list(self.clients.items()):
            st = await quiet(c.status(timeout=5))
            states[str(r)] = st.get("state", "unreachable") if isinstance(st, dict) else "unreachable"
        return states


def short_error(e: BaseException) -> str:
    """The last line of an error (a remote traceback's message), at most 300 characters."""
    text = str(e).strip().splitlines()
    last = text[-1] if text else type(e).__name__
    return last[:300]


async def quiet(aw: Awaitable[Any]) -> Any:
    """Await ``aw``; an exception is returned, not raised (cleanup, status probes)."""
    try:
        return await aw
    except Exception as e:  # noqa: BLE001 - best effort
        return e
