"""Per-step collectives and point-to-point moves through CUDA IPC among the ranks of one host.

The approach of vLLM's custom all-reduce, in the smaller form the reference engine needs: every
rank allocates its collective buffers in its own device memory and opens its peers' through CUDA
IPC handles (``torch.multiprocessing``'s reductions, passed once through the group's store), so a
device tensor goes device to device, never through host memory or a socket. The flags that order
the exchange are those of the shared-memory transport (``engine_ext.transport.shm``: one segment
of control lines among the local ranks); a rank makes its device copies complete (a stream
synchronisation) before it raises a flag, so a peer that sees the flag reads finished data. CPU
tensors of the same group (a step's header, a barrier) go through that segment's host buffers.

Point-to-point moves (``engine_ext.transport.p2p``: the expert reshuffle, the dense weights a
joiner receives) read the sender's storage where it lives: ``share_pieces`` publishes a handle of
each storage the pieces lie in, ``fetch_pieces`` maps them on the receiver.

Ranks that share one GPU take it: a collective combines every peer's buffer on this rank's
device, so a world whose ranks own GPUs of their own (the launcher's ``cuda-per-rank``) stays on
gloo, staged through host memory (``StatelessGroup._one_host`` compares the devices' UUIDs too;
NCCL for such worlds needs a machine of several GPUs to be built on, not lent here). A CUDA world
of one device takes it unless ``EEPCTL_CUDA_IPC=0`` is in the ranks' environment. The
GPU tests: ``tests/test_transport.py::test_cuda_ipc_collectives_and_moves_equal_gloo_on_one_gpu``
and ``tests/test_cuda_graphs.py`` (docs/testing.md, "The GPU path").
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import torch

from engine_ext.transport import shm
from engine_ext.transport.shm import ShmCollectives

HOST_BYTES = 64 * 1024  # host buffers per rank: headers and barriers, not the device exchanges


ENABLE_ENV = "EEPCTL_CUDA_IPC"  # "0": CUDA worlds stay on gloo (the operator's way out)


def supported(device: torch.device) -> bool:
    """CUDA IPC needs a CUDA device and the shared-memory flags (x86-64 store order), and is not
    turned off (``EEPCTL_CUDA_IPC=0``)."""
    return device.type == "cuda" and shm.supported() and os.environ.get(ENABLE_ENV, "1") != "0"


def _share(t: torch.Tensor) -> tuple[Any, ...]:
    """A picklable handle of the whole storage under ``t`` (as ``t``'s dtype, from offset 0)."""
    from torch.multiprocessing.reductions import reduce_tensor

    storage = t.untyped_storage()
    whole = t.new_empty(0).set_(storage, 0, (storage.nbytes() // t.element_size(),))
    return reduce_tensor(whole)[1]


def _open(args: tuple[Any, ...]) -> torch.Tensor:
    """The peer's storage, mapped into this process (torch caches the mapping per allocation)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*args)


def share_pieces(items: list[tuple[torch.Tensor, int]]) -> tuple[Any, ...]:
    """A move's descriptor: a handle of each storage the pieces lie in, and where each lies."""
    storages: dict[tuple[int, torch.dtype], int] = {}
    shared, pieces = [], []
    for t, tag in items:
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in storages:
            storages[key] = len(shared)
            shared.append(_share(t))
        pieces.append((tag, storages[key], tuple(t.shape), tuple(t.stride()), t.storage_offset()))
    return ("ipc", shared, pieces)


def fetch_pieces(descriptor: tuple[Any, ...]) -> dict[int, torch.Tensor]:
    """The sender's pieces by tag, as views of its storages mapped here (read, never written)."""
    _, shared, pieces = descriptor
    storages = [_open(a) for a in shared]
    return {tag: storages[s].as_strided(shape, stride, off) for tag, s, shape, stride, off in pieces}


class CudaIpcCollectives(ShmCollectives):
    """``ShmCollectives`` whose device tensors go through IPC-mapped device buffers."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        capacity: int,
        timeout_s: float,
        device: torch.device,
        on_setup: Callable[[], None] | None = None,
    ) -> None:
        self.device = device
        super().__init__(store, rank, size, capacity, timeout_s, on_setup)

    def _host_capacity(self) -> int:
        return HOST_BYTES

    def _map_device(self, store: Any) -> list[torch.Tensor]:
        mine = torch.empty((2, self.capacity), dtype=torch.uint8, device=self.device)
        store.set(f"ipc/buf/{self.rank}", pickle.dumps(_share(mine)))
        torch.cuda.synchronize(self.device)  # the allocation is complete before a peer maps it
        return [
            mine if j == self.rank else _open(pickle.loads(store.get(f"ipc/buf/{j}"))).view(2, self.capacity)
            for j in range(self.size)
        ]

    def _sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
