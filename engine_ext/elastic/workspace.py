"""One scratch buffer per rank for the MoE path (invariants I3, I4).

It grows on demand while unlocked; once locked, asking for more is an error that names
the bytes held and needed, instead of a silent reallocation under captured graphs.
A transition right-sizes it for the new world (``reserve`` shrinks as well as grows) and
``lock(required)`` refuses a buffer of any other size, so a skipped re-warm fails loudly in
both directions: too small for a bigger world, or holding bytes a smaller world gave back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_ALIGN = 64


class WorkspaceSizeError(RuntimeError):
    """Locking a workspace whose size is not the one the current world needs."""

    def __init__(self, held: int, needed: int) -> None:
        what = "too small for" if held < needed else "larger than"
        super().__init__(
            f"workspace holds {held} bytes, {what} the {needed} bytes this world needs; "
            "it was not re-sized (unlock, reserve, warm) for the new world before locking"
        )
        self.held = held
        self.needed = needed


class WorkspaceLockedError(RuntimeError):
    def __init__(self, held: int, needed: int) -> None:
        super().__init__(
            f"workspace is locked at {held} bytes but this step needs {needed} bytes; "
            "it must be re-sized (unlock, warm, lock) in a transition before serving"
        )
        self.held = held
        self.needed = needed


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for dim in shape:
        n *= int(dim)
    return n * torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def bytes_for(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    return sum(_aligned(_nbytes(shape, dtype)) for shape, dtype in specs)


class WorkspaceManager:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffer: torch.Tensor | None = None
        self._locked = False
        self.generation = 0  # bumped on every reallocation
        self.high_water = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def locked(self) -> bool:
        return self._locked

    def buffer_identity(self) -> tuple[int, int]:
        """(data pointer, generation): what a captured step remembers about the buffer."""
        ptr = 0 if self._buffer is None else self._buffer.data_ptr()
        return ptr, self.generation

    def lock(self, required: int | None = None) -> None:
        """Lock; with ``required``, only a buffer of exactly that size (else WorkspaceSizeError)."""
        if required is not None and self.nbytes != required:
            raise WorkspaceSizeError(self.nbytes, required)
        self._locked = True

    def unlock(self) -> None:
        self._locked = False

    def reserve(self, nbytes: int) -> None:
        """Right-size the buffer to exactly ``nbytes``: grow, or shrink and give bytes back."""
        if self._buffer is not None and self._buffer.numel() == nbytes:
            return
        if self._locked:
            raise WorkspaceLockedError(self.nbytes, nbytes)
        self._buffer = None  # the old buffer goes before the new one is allocated
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.generation += 1
        self.high_water = max(self.high_water, nbytes)

    def _ensure(self, needed: int) -> torch.Tensor:
        self.high_water = max(self.high_water, needed)
        if self._buffer is not None and self._buffer.numel() >= needed:
            return self._buffer
        if self._locked:
            raise WorkspaceLockedError(self.nbytes, needed)
        grown = torch.empty(needed, dtype=torch.uint8, device=self.device)
        if self._buffer is not None:  # views carved earlier in this step keep their contents
            grown[: self._buffer.numel()].copy_(self._buffer)
        self._buffer = grown
        self.generation += 1
        return self._buffer

    def get(self, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
        """Views carved from the one buffer, one per (shape, dtype)."""
        buf = self._ensure(bytes_for(specs))
        views: list[torch.Tensor] = []
        offset = 0
        for shape, dtype in specs:
            n = _nbytes(shape, dtype)
            views.append(buf[offset : offset + n].view(dtype).view(*shape))
            offset += _aligned(n)
        return views

    def describe(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "locked": self._locked, "generation": self.generation}
