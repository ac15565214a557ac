"""Point-to-point moves among the ranks of one host (the expert reshuffle, a joiner's dense weights).

A move between two ranks of one host need not cross a socket. The sender publishes, per receiver
and exchange, where the pieces are; the receiver copies them into its tensors and says when it is
done; the sender returns only then (its slots may be overwritten after):

* CPU: the sender copies its pieces into one shared-memory file (``/dev/shm``, reserved whole
  before any byte is written, so a full tmpfs fails the move with a clear error, not SIGBUS);
  the receiver maps it, removes its name and copies out. One copy in, one out; no kernel socket
  buffers, no TCP.
* CUDA (``engine_ext.transport.cuda_ipc``): the receiver maps the sender's storage through a CUDA
  IPC handle and copies device to device, from the live weights (they do not change while a
  deployment serves); nothing is staged.

The handshake goes through the group's store (a key per pair and exchange: both sides count the
exchanges between them, so the n-th of a pair meets the n-th); waits end as a collective's do
(``ShmCollectives.wait_peer``: the peer's process gone or departed, an abort, the timeout). A
receiver takes its senders in the order they publish.
"""

from __future__ import annotations

import math
import mmap
import os
import pickle
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from engine_ext.transport.shm import ShmCollectives
from engine_ext.transport.shm_files import ShmError, create_file, remove_file

Piece = tuple[torch.Tensor, int, int]  # (tensor, peer, tag)
ALIGN = 64
# This process's live shared allocations: base address -> (size, fd). An entry goes, and its fd is
# closed, when the last tensor over the allocation is freed (a finalizer on its mapping).
_regions: dict[int, tuple[int, int]] = {}


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor in memory a peer process of this host can map (an anonymous memory file: freed
    with the last tensor over it, never left in /dev/shm): a move reads it in place, one copy."""
    n = max(1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
    fd = os.memfd_create("eepctl-experts")
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
    except OSError:
        os.close(fd)
        raise
    t = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor (and every view of it) holds ``mm``
    base = t.data_ptr()
    _regions[base] = (n, fd)
    weakref.finalize(mm, _release, base, fd)
    return t[: n - n % torch.empty((), dtype=dtype).element_size()].view(dtype)[: math.prod(shape)].view(shape)


def _release(base: int, fd: int) -> None:
    """The allocation at ``base`` is unmapped: forget it and close its memory file."""
    _regions.pop(base, None)
    os.close(fd)


def _region_of(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(base, size, fd) of the shared allocation ``t`` lies in, or None."""
    p = t.data_ptr()
    for base, (size, fd) in list(_regions.items()):
        if base <= p < base + size:
            return base, size, fd
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StagedSender:
    """CPU: the pieces for one receiver: where they lie when they lie in a shared allocation (the
    receiver reads them in place), else copied into a shared-memory file of their own."""

    def __init__(self, items: list[tuple[torch.Tensor, int]]) -> None:
        in_place = []
        for t, tag in items:
            r = _region_of(t)
            if r is not None:
                in_place.append(
                    (
                        tag,
                        os.getpid(),
                        r[2],
                        os.fstat(r[2]).st_ino,
                        r[1],
                        t.dtype,
                        tuple(t.shape),
                        tuple(t.stride()),
                        (t.data_ptr() - r[0]) // t.element_size(),
                    )
                )
        if len(in_place) == len(items):
            self.path = ""
            self.descriptor = ("shm", "", 0, [], in_place)
            return
        offsets, end = [], 0
        for t, _ in items:
            offsets.append(end)
            end += -(-_nbytes(t) // ALIGN) * ALIGN
        self.path, mm = create_file("eepctl-mv", max(end, 1))  # reserved whole: a full tmpfs is an error
        for (t, _), off in zip(items, offsets):
            n = _nbytes(t)
            if n:
                part = torch.frombuffer(mm, dtype=torch.uint8, offset=off, count=n)
                part.copy_(t.contiguous().view(-1).view(torch.uint8))
        del mm  # the receiver maps the file by name
        self.descriptor = (
            "shm",
            self.path,
            max(end, 1),
            [(tag, off, t.dtype, tuple(t.shape)) for (t, tag), off in zip(items, offsets)],
            [],
        )

    def unlink(self) -> None:
        if self.path:  # normally the receiver removed it once mapped
            remove_file(self.path)


def _peer_bytes(pid: int, fd: int, ino: int, size: int) -> torch.Tensor:
    """A peer's shared allocation, mapped here for one move (through /proc: the file has no name;
    not kept: a mapping would keep a dead peer's memory alive)."""
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        if os.fstat(f).st_ino != ino:  # the pid and fd were reused: not the sender's allocation
            raise ShmError("peer_gone", f"move: rank process {pid} is gone (its fd {fd} is another file)")
        return torch.frombuffer(mmap.mmap(f, size), dtype=torch.uint8)
    finally:
        os.close(f)


def fetch_staged(descriptor: tuple[Any, ...]) -> dict[int, torch.Tensor]:
    """The sender's pieces by tag: views of its shared allocation, or of its file (mapped here, its
    name removed)."""
    _, path, size, pieces, in_place = descriptor
    mapped: dict[tuple[int, int], torch.Tensor] = {}
    out = {}
    for tag, pid, fd, ino, n, dtype, shape, stride, off in in_place:
        if (pid, fd) not in mapped:
            mapped[(pid, fd)] = _peer_bytes(pid, fd, ino, n)
        out[tag] = mapped[(pid, fd)].view(dtype).as_strided(shape, stride, off)
    if not path:
        return out
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
        remove_file(path)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    out.update(
        {
            tag: buf[off : off + torch.empty((), dtype=dtype).element_size() * math.prod(shape)].view(dtype).view(shape)
            for tag, off, dtype, shape in pieces
        }
    )
    return out


class PeerMoves:
    """``exchange`` of one group's point-to-point moves through memory its ranks share."""

    def __init__(
        self,
        flags: ShmCollectives,
        store: Any,
        rank: int,
        device: torch.device,
        share: Callable[[list[tuple[torch.Tensor, int]]], tuple[Any, ...]] | None = None,
        fetch: Callable[[tuple[Any, ...]], dict[int, torch.Tensor]] | None = None,
    ) -> None:
        self.flags, self.store, self.rank, self.device = flags, store, rank, device
        self.share, self.fetch = share, fetch  # device moves (CUDA IPC); None: staged in shared memory
        self._seq: dict[tuple[int, int], int] = {}
        # where this group's moves spent their time so far (a scale's pre-copy reports it):
        # publishing this rank's pieces, waiting for a peer's descriptor or ack, mapping its
        # pieces, copying them (to the synchronisation)
        self.seconds = {"publish_s": 0.0, "wait_s": 0.0, "map_s": 0.0, "copy_s": 0.0}

    @property
    def stages(self) -> bool:
        """Whether a move may stage its bytes (CPU: pieces outside a shared allocation are copied
        into a file first); CUDA IPC reads the sender's storage in place and holds nothing."""
        return self.share is None

    def _key(self, src: int, dst: int) -> str:
        n = self._seq.get((src, dst), 0)
        self._seq[(src, dst)] = n + 1
        return f"p2p/{src}-{dst}/{n}"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _wait(self, keys: dict[int, str]) -> int:
        """Wait until one of ``keys`` (peer -> store key) is set; return that peer."""
        t = time.perf_counter()
        found: list[int] = []

        def ready() -> bool:
            for p, k in keys.items():
                if self.store.check([k]):
                    found.append(p)
                    return True
            return False

        self.flags.wait_peer(ready, sorted(keys), "move")
        self.seconds["wait_s"] += time.perf_counter() - t
        return found[0]

    def exchange(self, sends: list[Piece], recvs: list[Piece]) -> int:
        """Every (tensor, dst, tag) of ``sends`` to its receiver, every (tensor, src, tag) of
        ``recvs`` from its sender; returns the bytes received."""
        self.flags.check_usable("move")
        staged: list[StagedSender] = []
        try:
            done = self._publish(sends, staged)
            received = self._receive(recvs)
            for dst, key in done:
                self._wait({dst: key})
        finally:
            for s in staged:
                s.unlink()  # normally the receiver did; a failed move leaves nothing in /dev/shm
        return received

    def _publish(self, sends: list[Piece], staged: list[StagedSender]) -> list[tuple[int, str]]:
        by_dst: dict[int, list[tuple[torch.Tensor, int]]] = {}
        for t, dst, tag in sends:
            by_dst.setdefault(dst, []).append((t, tag))
        t0 = time.perf_counter()
        if self.share is None:
            self._sync()  # what is sent is written before a peer reads it
        # (CUDA IPC needs no host wait: torch records an event on this stream with each handle, and
        # the receiver's stream waits on it before its copy; a host sync here waited for this
        # rank's serving step queued on the stream, up to a step's time on a shared GPU)
        done = []
        for dst, items in sorted(by_dst.items()):
            if self.share is not None:
                descriptor = self.share(items)
            else:
                staged.append(StagedSender(items))
                descriptor = staged[-1].descriptor
            key = self._key(self.rank, dst)
            self.store.set(key, pickle.dumps(descriptor))
            done.append((dst, f"{key}/done"))
        self.seconds["publish_s"] += time.perf_counter() - t0
        return done

    def _receive(self, recvs: list[Piece]) -> int:
        by_src: dict[int, list[tuple[torch.Tensor, int]]] = {}
        for t, src, tag in recvs:
            by_src.setdefault(src, []).append((t, tag))
        received, acks = 0, []
        opened = []  # the senders' pieces, kept mapped until the copies out of them are complete
        pending = {src: self._key(src, self.rank) for src in sorted(by_src)}
        while pending:  # the senders in the order they publish: a late one holds up no other's copy
            src = self._wait(pending)
            key, items = pending.pop(src), by_src[src]
            t_map = time.perf_counter()
            descriptor = pickle.loads(self.store.get(key))
            pieces = (self.fetch or fetch_staged)(descriptor)
            t_copy = time.perf_counter()
            self.seconds["map_s"] += t_copy - t_map
            for t, tag in items:
                if tag not in pieces:
                    raise ValueError(f"move {key}: rank {src} sent no piece tagged {tag}")
                t.copy_(pieces[tag], non_blocking=True)
                received += _nbytes(t)
            if self.device.type == "cuda":  # queued copies (a CPU copy is done, its mapping may go now)
                opened.append(pieces)
            del pieces
            acks.append(f"{key}/done")
            self.seconds["copy_s"] += time.perf_counter() - t_copy
        if acks:
            t_sync = time.perf_counter()
            self._sync()  # the copies are complete before the sender goes on (and before a mapping is dropped)
            self.seconds["copy_s"] += time.perf_counter() - t_sync
        opened.clear()
        for k in acks:
            self.store.set(k, b"1")
        return received
