"""``scale --request-id``: a retry with the same id gets the same operation, never a second one,
and never "already running" because the first is still being admitted.

The id is taken before the first await of the admission (``admit``): a retry that arrives while
the first is admitted waits for it (``first_settled``) and then gets its operation, or its refusal.
``ops`` is durable (the controller's snapshot): after a controller restart a retry still finds it.
Transport-free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from engine_ext.protocol import EepError, PreconditionError

T = TypeVar("T")


class RequestIds:
    """Idempotency keys of one deployment's scales."""

    def __init__(self, ops: dict[str, str] | None = None) -> None:
        self.ops: dict[str, str] = dict(ops or {})  # request id -> op id
        self._admitting: dict[str, tuple[int, asyncio.Future[Any]]] = {}  # ids being admitted

    async def first_settled(self, request_id: str | None, target: int) -> None:
        """When a scale with this id is being admitted: wait for it. Raises what refused it (the
        retry gets the same answer), or when the target differs; else its op is in ``ops`` now."""
        if not request_id or request_id not in self._admitting:
            return
        first_target, admitted = self._admitting[request_id]
        if first_target != target:
            raise PreconditionError(f"request id {request_id!r} is being used for DP {first_target}, not DP {target}")
        refusal = await asyncio.shield(admitted)
        if refusal is not None:
            raise refusal

    async def admit(
        self, request_id: str | None, target: int, admit: Callable[[], Awaitable[T]], hold_s: float = 0.0
    ) -> T:
        """Run ``admit`` with the id taken before its first await; ``end`` follows once the
        operation runs. ``hold_s``: a test's window for a retry (fault ``hold:admit``)."""
        if request_id:
            self._admitting[request_id] = (target, asyncio.get_running_loop().create_future())
        try:
            if hold_s > 0:
                await asyncio.sleep(hold_s)
            return await admit()
        except EepError as e:
            self.end(request_id, refusal=e)
            raise
        except BaseException:
            self.end(request_id, refusal=EepError("the first request with this id was cancelled"))
            raise

    def end(self, request_id: str | None, *, op_id: str | None = None, refusal: EepError | None = None) -> None:
        """The admission ended: with ``op_id`` admitted (and running), else refused by ``refusal``."""
        if not request_id:
            return
        if op_id:
            self.ops[request_id] = op_id
        entry = self._admitting.pop(request_id, None)
        if entry is not None and not entry[1].done():
            entry[1].set_result(None if op_id else refusal)

    def recent(self, keep: int = 100) -> dict[str, str]:
        return dict(list(self.ops.items())[-keep:])
