"""Per-step collectives through one shared-memory segment among the ranks of one host.

The idea is that of vLLM's CPU shared-memory communicator (every rank writes its part into a
buffer all ranks map, raises a flag, and reads the others' parts once their flags are up); this
is our own, smaller form of it, sized for the reference engine's per-step exchanges.

Layout of the segment (one per group, so one per world: a new world maps a new segment)::

    control  int64 [size, 8], one cache line per rank: seq, done, pid, left, attached
    data     bytes [size, 2, capacity]: each rank's two buffers, used in turn

A collective of generation ``g`` (every rank counts the same collectives in the same order):
wait until every rank is ``done`` with ``g - 2`` (the buffer about to be written was last read
then), write this rank's part into its buffer ``g % 2``, set ``seq = g``, wait until every
``seq >= g``, read, set ``done = g``. A store is seen by the others after the stores before it
(x86's total store order; ``supported()`` says no elsewhere, and the group then stays on gloo).

Waiting never spins for long: 0.1 ms of polling, then ``sched_yield`` to 2 ms, then sleeps
that grow to a millisecond (an idle rank sleeps on the store, not here). A wait ends with
``ShmError``: ``timeout`` after ``timeout_s`` (the group's, or the step's while serving);
``peer_gone`` when a peer's process is gone or it left the group short of this collective (one
that wrote its part and then left, as a committing rank leaves the old group, blocks no one: the
collective completes, the next one fails); ``aborted`` when this rank aborted the group
(``abort`` wakes its waiters within a sleep); ``overflow`` when a collective is larger than the
segment was sized for (before any data is written: every member refuses the same collective, and
the group stays usable; an all-to-all's parts differ per rank, so its refusal travels in the
headers of one exchange).
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine_ext.transport.shm_files import ShmError, create_file, process_alive, remove_file

SEQ, DONE, PID, LEFT, ATTACHED = range(5)
LINE = 8  # int64 words per rank's control line (64 bytes)
SPIN = 64  # polls before the clock is read
SPIN_S = 0.0001  # polls (no yield) for this long: a peer's step is usually this close
YIELD_S = 0.002  # then sched_yield until this long (gives the core to whoever else is runnable)
MAX_SLEEP_S = 0.001  # then sleeps growing to this
PROBE_S = 0.2  # how often a long wait looks for dead peers


def supported() -> bool:
    """Whether this machine orders stores as the protocol needs (x86-64: total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def _flag_pause() -> Callable[[float], None]:
    """A collective's pacing: polls for ``SPIN_S``, then ``sched_yield`` to ``YIELD_S`` (gives the
    core to whoever else is runnable), then sleeps doubling to ``MAX_SLEEP_S``."""
    sleep = 1e-5

    def pause(elapsed: float) -> None:
        nonlocal sleep
        if elapsed < SPIN_S:
            return
        if elapsed < YIELD_S:
            os.sched_yield()
        else:
            time.sleep(sleep)
            sleep = min(MAX_SLEEP_S, sleep * 2)

    return pause


class ShmCollectives:
    """All-reduce, all-gather and reduce-scatter of CPU tensors among ``size`` local processes.

    ``store`` (a torch.distributed store, prefixed for this group) carries only the segment's
    path, once. Rank 0 creates the segment; its name is removed once every rank has mapped it, or
    by whichever rank's set-up fails (a peer that died in set-up, a timeout, any error), so a
    killed deployment leaves nothing in /dev/shm. Construction returns when every rank has
    attached (``attached`` says how many ranks this rank saw: the preparation's evidence).
    ``on_setup`` runs once this rank has mapped the segment, before it counts as attached (the
    fault seam's hold in group set-up)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        capacity: int,
        timeout_s: float,
        on_setup: Callable[[], None] | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        self.capacity = _align(max(64, capacity))
        self.timeout_s = timeout_s
        self._aborted = False
        self._broken = ""
        self._gen = 0
        ctrl_bytes = _align(size * LINE * 8, 4096)
        self.host_capacity = self._host_capacity()
        total = ctrl_bytes + size * 2 * self.host_capacity
        self.path = ""
        attached = False
        try:
            self._mm = self._map_segment(store, total)
            self._ctrl = np.frombuffer(self._mm, dtype=np.int64, count=size * LINE).reshape(size, LINE)
            host = torch.frombuffer(
                self._mm, dtype=torch.uint8, offset=ctrl_bytes, count=size * 2 * self.host_capacity
            ).view(size, 2, self.host_capacity)
            self._host: list[torch.Tensor] = [host[j] for j in range(size)]  # each rank's two buffers
            self._device: list[torch.Tensor] | None = self._map_device(store)
            self._ctrl[rank, PID] = os.getpid()
            if on_setup is not None:
                on_setup()
            self._ctrl[rank, ATTACHED] = 1
            self._wait(ATTACHED, 1, "attach")
            attached = True
        finally:
            if self.path and (rank == 0 or not attached):
                remove_file(self.path)
        self.attached = int((self._ctrl[:, ATTACHED] > 0).sum())

    def _map_segment(self, store: Any, total: int) -> mmap.mmap:
        """Rank 0 creates the segment and publishes its path; the others map it by that path."""
        if self.rank == 0:
            self.path, mm = create_file("eepctl", total)
            store.set("shm/path", f"{self.path}|{total}")
            return mm
        path, n = store.get("shm/path").decode().rsplit("|", 1)
        self.path = path
        if int(n) != total:  # every rank must size the segment alike
            raise ValueError(f"shared-memory segment {path} is {n} bytes, this rank expects {total}")
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:  # a peer's set-up failed and removed it
            raise self._fail("peer_gone", f"attach: segment {path} was removed (a peer's set-up failed)") from None
        try:
            return mmap.mmap(fd, total)
        finally:
            os.close(fd)

    # ---- where a collective's parts go (engine_ext.transport.cuda_ipc adds device buffers) -------
    def _host_capacity(self) -> int:
        return self.capacity

    def _map_device(self, store: Any) -> list[torch.Tensor] | None:
        return None

    def _sync(self) -> None:
        """Make this rank's device writes (or reads) complete before a flag tells the peers."""

    def _buffers(self, t: torch.Tensor) -> tuple[list[torch.Tensor], int, bool]:
        """(every rank's buffer pair, their capacity, on the device) for a collective of ``t``."""
        if self._device is not None and t.device.type != "cpu":
            return self._device, self.capacity, True
        return self._host, self.host_capacity, False

    # ---- waiting -------------------------------------------------------------------------------
    def _wait(self, col: int, target: int, what: str) -> None:
        """Until every rank's ``col`` reaches ``target`` (a collective's flags): a few polls at
        once, then ``_until``'s loop with the spin, yield, sleep pacing."""
        column = self._ctrl[:, col]
        for _ in range(SPIN):
            if column.min() >= target:
                return
        self._until(
            lambda: column.min() >= target,
            lambda: [int(j) for j in np.nonzero(column < target)[0]],
            what,
            _flag_pause(),
        )

    def wait_peer(self, ready: Callable[[], bool], peers: list[int], what: str) -> None:
        """Wait until ``ready()`` (a condition outside the segment: a store key) as a collective
        waits for a flag: an abort, one of ``peers`` leaving or dying, and the timeout end it.

        A move's peer is usually a few milliseconds away (its step, its publish), so the wait looks
        again at once at first, then sleeps a twentieth of the time waited so far (up to
        ``MAX_SLEEP_S``): an answer is seen at most ~5 % late (a collective's doubling sleeps would
        add up to a millisecond to each handshake of a 2-3 ms expert move)."""
        self._until(ready, lambda: list(peers), what, lambda elapsed: time.sleep(min(MAX_SLEEP_S, elapsed / 20)))

    def _until(
        self, ready: Callable[[], bool], missing: Callable[[], list[int]], what: str, pause: Callable[[float], None]
    ) -> None:
        """The one wait: until ``ready()``, failing on an abort, on a rank of ``missing()`` (those
        not there yet) that left the group or whose process is gone (looked for every ``PROBE_S``),
        and after ``timeout_s``; ``pause(elapsed)`` between looks."""
        ctrl = self._ctrl
        t0 = time.perf_counter()
        probe = PROBE_S
        while not ready():
            elapsed = time.perf_counter() - t0
            if self._aborted:
                raise self._fail("aborted", f"{what}: this rank aborted the group")
            # A rank that left after writing its part of this collective (a committing rank leaves
            # the old group once it has read the agreeing header) blocks no one: only one that left
            # short of it fails the wait. LEFT is read before the flags: a rank writes its part
            # before it leaves. The cheap look first: this loop polls.
            if ctrl[:, LEFT].max() > 0:
                gone = ctrl[:, LEFT] > 0
                left = [j for j in missing() if gone[j]]
                if left and not ready():  # it may have answered, then left
                    raise self._fail("peer_gone", f"{what}: rank(s) {left} left the group")
            if elapsed > self.timeout_s:
                raise self._fail("timeout", f"{what}: rank(s) {missing()} did not arrive within {self.timeout_s:g} s")
            if elapsed > probe:
                probe = elapsed + PROBE_S
                dead = [j for j in missing() if ctrl[j, PID] > 0 and not process_alive(int(ctrl[j, PID]))]
                if dead and not ready():
                    raise self._fail("peer_gone", f"{what}: the process of rank(s) {dead} is gone")
            pause(elapsed)

    def check_usable(self, what: str) -> None:
        """Raise unless the group may run another exchange (not aborted, no failure before)."""
        if self._aborted:
            raise ShmError("aborted", f"shm {what}: this rank aborted the group")
        if self._broken:
            raise ShmError("aborted", f"shm {what}: the group failed before: {self._broken}")

    def _fail(self, code: str, message: str) -> ShmError:
        self._broken = self._broken or message
        return ShmError(code, f"shm {message}")

    # ---- one collective ------------------------------------------------------------------------
    def _begin(self, nbytes: int, what: str, bufs: list[torch.Tensor], cap: int) -> tuple[int, torch.Tensor]:
        self.check_usable(what)
        if nbytes > cap:  # every member sizes alike, so all refuse the same collective
            raise ShmError(
                "overflow",
                f"shm {what} of {nbytes} bytes does not fit the group's buffer of "
                f"{cap} bytes (sized for a smaller exchange)",
            )
        self._gen += 1
        g = self._gen
        if g > 2:  # the buffer about to be written (of either set) was last read at g - 2
            self._wait(DONE, g - 2, what)
        return g, bufs[self.rank][g % 2]

    def _publish_and_wait(self, g: int, what: str, on_device: bool) -> None:
        if on_device:
            self._sync()
        self._ctrl[self.rank, SEQ] = g
        self._wait(SEQ, g, what)

    @staticmethod
    def _part(bufs: list[torch.Tensor], j: int, g: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        return bufs[j][g % 2, offset : offset + n].view(like.dtype).view(like.shape)

    def _end(self, g: int, on_device: bool) -> None:
        if on_device:
            self._sync()
        self._ctrl[self.rank, DONE] = g

    @staticmethod
    def _put(buf: torch.Tensor, offset: int, t: torch.Tensor) -> int:
        n = t.numel() * t.element_size()
        buf[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
        return offset + n

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """``t`` becomes the elementwise sum or max over ranks, summed in rank order on every rank."""
        bufs, cap, dev = self._buffers(t)
        g, buf = self._begin(t.numel() * t.element_size(), f"all_reduce_{op}", bufs, cap)
        self._put(buf, 0, t)
        self._publish_and_wait(g, f"all_reduce_{op}", dev)
        parts = [self._part(bufs, j, g, 0, t) for j in range(self.size)]
        t.copy_(parts[0])
        for p in parts[1:]:
            if op == "max":
                torch.maximum(t, p, out=t)
            else:
                t.add_(p)
        self._end(g, dev)
        return t

    def all_gather(self, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
        self.all_gather_many([(outs, inp)])

    def all_gather_many(self, items: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
        """Several all-gathers in one exchange: each input at its own 64-byte-aligned offset (the
        inputs live on one device)."""
        offsets, end = [], 0
        for _, inp in items:
            offsets.append(end)
            end = _align(end + inp.numel() * inp.element_size())
        bufs, cap, dev = self._buffers(items[0][1])
        g, buf = self._begin(end, "all_gather", bufs, cap)
        for (_, inp), off in zip(items, offsets):
            self._put(buf, off, inp)
        self._publish_and_wait(g, "all_gather", dev)
        for (outs, inp), off in zip(items, offsets):
            for j, out in enumerate(outs):
                out.copy_(inp if j == self.rank else self._part(bufs, j, g, off, inp))
        self._end(g, dev)

    def reduce_scatter(self, out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        """``out`` = sum over ranks of their ``inputs[this rank]``, in rank order."""
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        bufs, cap, dev = self._buffers(out)
        g, buf = self._begin(nbytes, "reduce_scatter", bufs, cap)
        offset = 0
        offsets = []
        for t in inputs:
            offsets.append(offset)
            offset = self._put(buf, offset, t)
        self._publish_and_wait(g, "reduce_scatter", dev)
        mine = inputs[self.rank]
        out.copy_(self._part(bufs, 0, g, offsets[self.rank], mine))
        for j in range(1, self.size):
            out.add_(self._part(bufs, j, g, offsets[self.rank], mine))
        self._end(g, dev)

    def all_to_all_v(
        self, send: torch.Tensor, send_counts: list[int], recv_alloc: Callable[[int], torch.Tensor]
    ) -> list[int]:
        """Rows of ``send`` (ordered by destination, ``send_counts[j]`` rows for rank ``j``) to
        their ranks in one exchange: this rank's counts (a 64-byte-aligned header), then its rows.
        The rows for this rank land in rank order in ``recv_alloc(total rows)``; returns how
        many came from each rank. Parts differ in size, so a rank whose part does not fit says so
        in its header instead (-bytes) and every member raises ``overflow`` for the same exchange."""
        W, me = self.size, self.rank
        head = _align(W * 8)
        row = send.element_size() * math.prod(send.shape[1:])
        nbytes = head + send.shape[0] * row
        bufs, cap, dev = self._buffers(send)
        g, buf = self._begin(head, "all_to_all", bufs, cap)  # the header alone: every member sizes it alike
        if nbytes > cap:  # only this rank knows: its header tells the others (all refuse)
            buf[: W * 8].view(torch.int64).fill_(-nbytes)
        else:
            buf[: W * 8].view(torch.int64).copy_(torch.tensor(send_counts, dtype=torch.int64))
            if send.shape[0]:
                buf[head:nbytes].copy_(send.contiguous().view(-1).view(torch.uint8))
        self._publish_and_wait(g, "all_to_all", dev)
        headers = torch.stack([bufs[j][g % 2, : W * 8].view(torch.int64) for j in range(W)]).cpu()
        if over := [j for j in range(W) if int(headers[j, 0]) < 0]:
            sizes = ", ".join(f"rank {j}'s {-int(headers[j, 0])} bytes" for j in over)
            self._end(g, dev)
            raise ShmError(
                "overflow",
                f"shm all_to_all of {sizes} does not fit the group's buffer of "
                f"{cap} bytes (sized for a smaller exchange)",
            )
        counts = [int(c) for c in headers[:, me]]
        starts = [int(c) for c in headers[:, :me].sum(1)]
        out = recv_alloc(sum(counts)).view(-1).view(torch.uint8)
        at = 0
        for j in range(W):
            n = counts[j] * row
            if n:
                src = head + starts[j] * row
                out[at : at + n].copy_(bufs[j][g % 2, src : src + n])
                at += n
        self._end(g, dev)
        return counts

    # ---- teardown ------------------------------------------------------------------------------
    def abort(self) -> None:
        """Fail this rank's waits (its own thread's within a sleep) and tell the peers it left."""
        self._aborted = True
        try:
            self._ctrl[self.rank, LEFT] = 1
        except (AttributeError, ValueError):
            pass

    def close(self) -> None:
        """Leave the group and drop this object's views of the mapping. It is unmapped when the
        last view goes (never ``mmap.close()``: a tensor from ``torch.frombuffer`` holds the mmap
        object but not its buffer export, so closing would unmap under a thread still copying)."""
        self.abort()
        left = np.zeros((self.size, LINE), dtype=np.int64)
        left[:, LEFT] = 1
        self._ctrl, self._host, self._device = left, [], None
        self._mm = None
