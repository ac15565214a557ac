"""Stateless process groups over a TCPStore (invariant I2).

No ``torch.distributed.init_process_group``: a group is a ProcessGroupGloo (or NCCL) built
over a PrefixStore, so a new world can be formed for every operation while the process
lives, and dropped again on rollback.
"""

from __future__ import annotations

import datetime
import socket
import torch
import torch.distributed as dist

from engine_ext.elastic.rendezvous import Rendezvous


def local_ip() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the default route's address
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def host_store(host: str = "0.0.0.0") -> dist.TCPStore:
    """Start the store master of a deployment on a free port (rank 0 hosts it)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)


_clients: dict[tuple[str, int, str], dist.TCPStore] = {}


def store_client(host: str, port: int, timeout_s: float = 60.0, purpose: str = "groups") -> dist.TCPStore:
    """One client connection per (store, purpose). A client serializes its requests, so a
    long blocking wait (an idle rank's sleep) gets a connection of its own."""
    key = (host, port, purpose)
    if key not in _clients:
        _clients[key] = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return _clients[key]


class StatelessGroup:
    """A process group that can be created and dropped at any time."""

    def __init__(
        self,
        rdzv: Rendezvous,
        rank: int,
        size: int,
        *,
        timeout_s: float = 120.0,
        backend: str = "gloo",
        device: torch.device | None = None,
    ) -> None:
        self.rdzv = rdzv
        self.rank = rank
        self.size = size
        self.backend = backend
        self.device = device or torch.device("cpu")
        # A connection of its own per group: a rendezvous stuck on a dead peer (a prepare that
        # waits out its timeout) must not block the next operation's rendezvous (a recovery).
        store = dist.TCPStore(rdzv.host, rdzv.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        self.store = dist.PrefixStore(rdzv.prefix, store)
        # Wake-ups get connections of their own: the "groups" connection can sit for minutes in
        # a standby group's rendezvous (a joiner that died), and serving must not wait behind it.
        self.wait_store = dist.PrefixStore(rdzv.prefix, store_client(rdzv.host, rdzv.port, purpose="wait"))
        self.wake_store = dist.PrefixStore(rdzv.prefix, store_client(rdzv.host, rdzv.port, purpose="wake"))
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            self.pg: dist.ProcessGroup | None = dist.ProcessGroupGloo(self.store, rank, size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, size, opts)
        else:
            raise ValueError(f"unknown backend {backend!r}")
        # gloo cannot send/recv device tensors when ranks share one GPU: stage on the host.
        self.stage_p2p_on_host = backend == "gloo" and self.device.type == "cuda"

    def _pg(self) -> dist.ProcessGroup:
        if self.pg is None:
            raise RuntimeError(f"group {self.rdzv.prefix} was destroyed")
        return self.pg

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._pg().allreduce([t], opts).wait()
        return t

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        self._pg().allreduce([t]).wait()
        return t

    def all_gather(self, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
        self._pg().allgather([outs], [inp]).wait()

    def reduce_scatter(self, out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        self._pg().reduce_scatter([out], [inputs], dist.ReduceScatterOptions()).wait()

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg().broadcast([t], opts).wait()
        return t

    def barrier(self) -> None:
        self.all_reduce_sum(torch.zeros(1, dtype=torch.int64))

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> None:
        """Post every send (tensor, dst, tag) and recv (tensor, src, tag), then wait for all."""
        pg = self._pg()
        works = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t, dst, tag in sends:
            buf = t.cpu().contiguous() if self.stage_p2p_on_host else t.contiguous()
            works.append(pg.send([buf], dst, tag))
        for t, src, tag in recvs:
            if self.stage_p2p_on_host:
                host = torch.empty(t.shape, dtype=t.dtype)
                staged.append((t, host))
                works.append(pg.recv([host], src, tag))
            else:
                works.append(pg.recv([t], src, tag))
        for w in works:
            w.wait()
        for dev, host in staged:
            dev.copy_(host)

    def abort(self) -> None:
        """Drop the group at once, failing any collective a thread is blocked in (a peer died:
        never wait out the backend's timeout)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            for how in ("abort", "shutdown"):
                if hasattr(pg, how):
                    try:
                        getattr(pg, how)()
                        return
                    except Exception:  # a dead peer must not keep us from dropping the group
                        continue

    def destroy(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # a dead peer must not keep us from dropping the group
                pass
