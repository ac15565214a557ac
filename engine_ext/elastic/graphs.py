"""Captured decode steps, released and re-captured around transitions (invariant I3).

On CUDA a capture is a real ``torch.cuda.CUDAGraph``. On CPU there are no graphs, so a
capture is a static-buffer replay of a plan whose tensors were bound when it was built
(``MoEModel.plan``): like a CUDA graph, a replay reads the buffers it was captured with, so a
stale replay computes with stale tensors. A capture therefore remembers the storage of every
buffer it reads (static inputs, KV cache, weights, routing and block tables, MoE workspace)
and the group and world size it was captured in, and ``check`` refuses to replay once any of
them changed. ``verify=False`` (the ``no_stale_check`` fault) skips that check, to show the harm.
The manager also counts capture passes (one per transition, I4) where they happen, and, since
the last world switch (``open_window``), the replays per batch size and the steps served eagerly
because no capture existed for a size the config captures: "survivors kept replaying their
captures after the switch" is then read from counts, not from the captures merely existing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine_ext.elastic.workspace import WorkspaceManager

BufferMap = dict[str, torch.Tensor]
Step = tuple[str, Callable[[], None]]  # ("compute" | "comm", fn)


class StaleGraphError(RuntimeError):
    """A replay was attempted against a buffer that changed after capture."""


class GraphReleasedError(RuntimeError):
    """A replay was attempted for a batch size whose capture was released."""


@dataclass
class CaptureDescriptor:
    batch_size: int
    duration_s: float
    captured_at: float


@dataclass
class CapturedStep:
    batch_size: int
    inputs: BufferMap
    output: torch.Tensor
    buffer_ptrs: dict[str, int]
    workspace_identity: tuple[int, int]
    world: tuple[int, int]
    run: Callable[[], None]
    pieces: list[tuple[str, object]] | None = None  # CUDA: ("graph", CUDAGraph) | ("comm", fn)
    replays: int = 0
    captured_in: str = "startup"  # the operation whose capture pass made it


@dataclass
class GraphStats:
    total_captures: int = 0
    captures_this_op: int = 0
    replays: int = 0
    last_capture_s: float | None = None
    capture_durations: dict[int, float] = field(default_factory=dict)
    eager_fallbacks: int = 0  # decode steps served eagerly for want of a capture, since start-up


@dataclass
class ReplayWindow:
    """What the rank replayed since it switched to its current world (``op_id``'s)."""

    op_id: str = "startup"
    replays: dict[int, int] = field(default_factory=dict)  # batch size -> replays
    eager: dict[int, int] = field(default_factory=dict)  # batch size -> eager fallbacks


class GraphManager:
    """Owns the captured steps of one rank.

    ``external_buffers`` returns the long-lived tensors a step reads (KV cache, weights);
    their storage is remembered at capture and checked before every replay.
    """

    def __init__(
        self,
        device: torch.device,
        workspace: WorkspaceManager,
        external_buffers: Callable[[], BufferMap],
        world_key: Callable[[], tuple[int, int]] = lambda: (0, 1),
    ) -> None:
        self.device = device
        self.world_key = world_key  # (identity of the group, world size) a capture is bound to
        self.verify = True
        self.passes_this_op = 0
        self.use_cuda = device.type == "cuda"
        self.workspace = workspace
        self.external_buffers = external_buffers
        self._captured: dict[int, CapturedStep] = {}
        self.descriptors: dict[int, CaptureDescriptor] = {}
        self.stats = GraphStats()
        self.window = ReplayWindow()
        self.op_id = "startup"  # the operation under way (captures are labelled with it)
        self._pool = None

    @property
    def kind(self) -> str:
        return "cuda" if self.use_cuda else "cpu-static"

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._captured)

    def needs_capture(self, batch_size: int) -> bool:
        return batch_size in self.descriptors and batch_size not in self._captured

    def begin_operation(self, op_id: str = "") -> None:
        self.stats.captures_this_op = 0
        self.passes_this_op = 0
        self.op_id = op_id or self.op_id

    def open_window(self, op_id: str) -> None:
        """The rank serves in the world ``op_id`` made from now on: count its replays afresh."""
        self.window = ReplayWindow(op_id)

    def count_eager(self, batch_size: int) -> None:
        """A decode step of ``batch_size`` ran eagerly: no capture exists for it."""
        self.stats.eager_fallbacks += 1
        self.window.eager[batch_size] = self.window.eager.get(batch_size, 0) + 1

    @property
    def captured_in(self) -> dict[int, str]:
        return {size: step.captured_in for size, step in sorted(self._captured.items())}

    def begin_pass(self) -> None:
        """A capture pass over every capture size starts (I4: exactly one per transition)."""
        self.passes_this_op += 1

    def credit_pool_pass(self) -> None:
        """The pass this operation needs was taken in the standby pool, before adoption: count
        it here, once, so the operation's pass count (I4) says a joiner captured exactly once."""
        self.passes_this_op += 1

    def capture(
        self,
        batch_size: int,
        inputs: BufferMap,
        output: torch.Tensor,
        steps: list[Step],
    ) -> CaptureDescriptor:
        """Capture ``steps`` (read ``inputs``, write ``output``) for one batch size.

        On CUDA each run of compute steps becomes one CUDA graph and the collectives between
        them stay eager (gloo collectives cannot be captured): a piecewise capture.
        """
        t0 = time.perf_counter()
        pieces = None

        def run() -> None:
            for _, fn in steps:
                fn()

        if self.use_cuda:
            pieces = self._capture_cuda(steps)
        else:
            run()
        duration = time.perf_counter() - t0
        step = CapturedStep(
            batch_size=batch_size,
            inputs=inputs,
            output=output,
            buffer_ptrs=self._pointers(inputs),
            workspace_identity=self.workspace.buffer_identity(),
            world=self.world_key(),
            run=run,
            pieces=pieces,
            captured_in=self.op_id,
        )
        self._captured[batch_size] = step
        desc = CaptureDescriptor(batch_size, duration, time.time())
        self.descriptors[batch_size] = desc
        self.stats.total_captures += 1
        self.stats.captures_this_op += 1
        self.stats.last_capture_s = duration
        self.stats.capture_durations[batch_size] = duration
        return desc

    def _capture_cuda(self, steps: list[Step]) -> list[tuple[str, object]]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up run, as CUDA graph capture requires
            for _, fn in steps:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        pieces: list[tuple[str, object]] = []
        pending: list[Callable[[], None]] = []

        def flush() -> None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                for f in pending:
                    f()
            pieces.append(("graph", graph))
            pending.clear()

        for kind, fn in steps:
            if kind == "compute":
                pending.append(fn)
                continue
            if pending:
                flush()
            torch.cuda.synchronize()
            fn()  # every rank issues the same collective here, so capture stays in lockstep
            pieces.append(("comm", fn))
        if pending:
            flush()
        torch.cuda.synchronize()
        return pieces

    def _pointers(self, inputs: BufferMap) -> dict[str, int]:
        ptrs = {f"input:{k}": t.data_ptr() for k, t in inputs.items()}
        ptrs.update({k: t.data_ptr() for k, t in self.external_buffers().items()})
        return ptrs

    def check(self, batch_size: int) -> CapturedStep:
        """Raise unless the capture for ``batch_size`` may replay safely."""
        step = self._captured.get(batch_size)
        if step is None:
            if batch_size in self.descriptors:
                raise GraphReleasedError(f"graph for batch size {batch_size} was released")
            raise KeyError(f"no graph captured for batch size {batch_size}")
        if not self.verify:
            return step
        if self.world_key() != step.world:
            raise StaleGraphError(
                f"graph for batch size {batch_size} was captured in world {step.world[1]} (group "
                f"{step.world[0]:#x}), now {self.world_key()[1]} (group {self.world_key()[0]:#x})"
            )
        if self.workspace.buffer_identity() != step.workspace_identity:
            raise StaleGraphError(
                f"graph for batch size {batch_size} was captured against workspace generation "
                f"{step.workspace_identity[1]}, which was reallocated (now generation "
                f"{self.workspace.generation}); release and re-capture before replaying"
            )
        now_ptrs = self._pointers(step.inputs)
        for name, ptr in step.buffer_ptrs.items():
            if now_ptrs.get(name) != ptr:
                raise StaleGraphError(
                    f"graph for batch size {batch_size}: buffer {name!r} was reallocated after capture"
                )
        return step

    def replay(self, batch_size: int) -> torch.Tensor:
        step = self.check(batch_size)
        if step.pieces is not None:
            for kind, item in step.pieces:
                if kind == "graph":
                    item.replay()  # type: ignore[attr-defined]
                else:
                    item()  # type: ignore[operator]
        else:
            step.run()
        step.replays += 1
        self.stats.replays += 1
        self.window.replays[batch_size] = self.window.replays.get(batch_size, 0) + 1
        return step.output

    def release(self) -> int:
        """Drop every capture; keep descriptors so 'needs capture' stays known."""
        n = len(self._captured)
        self._captured.clear()
        if self.use_cuda:
            self._pool = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return n
