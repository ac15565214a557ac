"""A CPU device communicator with the collectives vLLM's MoE paths need under DP + EP.

vLLM 0.32's ``CpuCommunicator`` inherits ``all_gatherv``, ``reduce_scatterv`` and
``batch_isend_irecv`` from ``DeviceCommunicatorBase``, which raises ``NotImplementedError``
(``vllm/distributed/device_communicators/base_device_communicator.py:290-296,331-334,475-476``).
The CPU all2all manager (``AgRsAll2AllManager``, ``all2all.py:118,148,168``) calls the first two
on every MoE layer once DP > 1 with expert parallelism, so a static DP=2 + EP server fails on its
first request, and EPLB's weight moves call the third. This subclass implements them over the
group's gloo process group (``torch.distributed``), with the CUDA communicator's semantics:
``sizes`` are the per-rank row counts along dim 0, the output concatenates (gather) or sums
and splits (reduce-scatter) in rank order.

Reductions run in float32 and are rounded once, so a sum over ranks rounds like the sum one
rank computes over all its experts at DP=1. The class is built on first access (module
``__getattr__``): importing this module imports nothing of vLLM.
"""

from __future__ import annotations

from typing import Any

QUALNAME = "engine_ext.vllm.cpu_communicator.EepCpuCommunicator"
_cls: type | None = None


def __getattr__(name: str) -> Any:
    if name == "EepCpuCommunicator":
        return communicator_class()
    raise AttributeError(name)


def communicator_class() -> type:
    """``EepCpuCommunicator``, a subclass of vLLM's ``CpuCommunicator`` (built once)."""
    global _cls
    if _cls is None:
        _cls = _build()
    return _cls


def _chunks(sizes: list[int] | None, total: int, world: int) -> list[int]:
    if sizes is None:
        if total % world:
            raise ValueError(f"{total} rows do not split evenly over {world} ranks")
        return [total // world] * world
    if len(sizes) != world or sum(sizes) != total:
        raise ValueError(f"sizes {sizes} do not cover {total} rows over {world} ranks")
    return list(sizes)


def gatherv(comm: Any, t: Any, sizes: list[int] | None) -> Any:
    """Rows of every rank, concatenated in rank order; each rank holds ``sizes[rank]`` rows."""
    import torch
    import torch.distributed as dist

    world = comm.world_size
    if world == 1:
        return t
    sizes = sizes if sizes is not None else [t.shape[0]] * world
    if len(sizes) != world or t.shape[0] != sizes[comm.rank_in_group]:
        raise ValueError(f"rank {comm.rank_in_group} holds {t.shape[0]} rows, sizes say {sizes}")
    most = max(sizes)
    padded = t.new_zeros((most,) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    out = t.new_empty((world * most,) + tuple(t.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=comm.device_group)
    return torch.cat([out[r * most : r * most + n] for r, n in enumerate(sizes)])


def reduce_scatterv(comm: Any, input_: Any, dim: int, sizes: list[int] | None) -> Any:
    """The sum over ranks of ``input_``, this rank's chunk of it along ``dim`` (float32 sum)."""
    import torch
    import torch.distributed as dist

    world = comm.world_size
    if world == 1:
        return input_
    if dim < 0:
        dim += input_.dim()
    moved = input_.movedim(0, dim)
    chunks = _chunks(sizes, moved.shape[0], world)
    total = moved.to(torch.float32).contiguous()
    dist.all_reduce(total, group=comm.device_group)
    start = sum(chunks[: comm.rank_in_group])
    mine = total[start : start + chunks[comm.rank_in_group]].to(input_.dtype)
    return mine.movedim(0, dim).contiguous()


def batch_isend_irecv(comm: Any, p2p_ops: list) -> None:
    """Run ``P2POp``s whose peers are ranks of the group. vLLM builds some with ``object.__new__``
    (no ``group``), so fields are read defensively. A stateless group is unknown to torch, which
    then cannot map its ranks: there the group's own ``send``/``recv`` run."""
    import torch.distributed as dist

    works = []
    for op in p2p_ops:
        peer = getattr(op, "group_peer", None)
        peer = peer if peer is not None else comm.ranks.index(op.peer)
        group = getattr(op, "group", None) or comm.device_group
        sending = op.op in (dist.isend, dist.send)
        if comm.stateless:
            works.append(group.send([op.tensor], peer, 0) if sending else group.recv([op.tensor], peer, 0))
        elif sending:
            works.append(dist.isend(op.tensor, group=group, group_dst=peer))
        else:
            works.append(dist.irecv(op.tensor, group=group, group_src=peer))
    for w in works:
        w.wait()


def _init_stateless(
    comm: Any,
    cpu_group: Any,
    device: Any,
    device_group: Any,
    unique_name: str,
    global_ranks: list[int] | None,
    global_world_size: int | None,
    tcp_store_group: Any,
    use_all2all: bool,
) -> None:
    """Set up over a stateless group (unknown to torch.distributed): no shared-memory fast path
    (it needs the group's ranks from torch), vLLM's CPU all2all manager over it."""
    import torch.distributed as dist
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    DeviceCommunicatorBase.__init__(
        comm, cpu_group, device, device_group, unique_name, global_ranks, global_world_size, use_all2all=use_all2all
    )
    comm.dist_module = dist
    comm.supports_tensor_dict = False
    if comm.use_all2all:
        from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

        comm.all2all_manager = AgRsAll2AllManager(comm.cpu_group, tcp_store_group)


def _build() -> type:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    class EepCpuCommunicator(CpuCommunicator):
        """vLLM's CPU communicator plus variable-size gather/reduce-scatter and batched p2p, also
        over elastic EP's stateless groups (which vLLM builds only with ``CudaCommunicator``)."""

        def __init__(
            self,
            cpu_group: Any,
            device: Any = None,
            device_group: Any = None,
            unique_name: str = "",
            global_ranks: list[int] | None = None,
            global_world_size: int | None = None,
            tcp_store_group: Any = None,
            use_all2all: bool = False,
        ) -> None:
            from torch.distributed.distributed_c10d import _world

            self.stateless = _world.pg_map.get(cpu_group) is None
            if self.stateless:
                _init_stateless(
                    self,
                    cpu_group,
                    device,
                    device_group,
                    unique_name,
                    global_ranks,
                    global_world_size,
                    tcp_store_group,
                    use_all2all,
                )
            else:
                super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)

        def all_gatherv(self, input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
            if dim != 0:
                raise NotImplementedError("only dim 0 all-gatherv is supported")
            if isinstance(input_, (list, tuple)):
                return [gatherv(self, t, sizes) for t in input_]
            return gatherv(self, input_, sizes)

        def reduce_scatterv(self, input_: Any, dim: int = -1, sizes: list[int] | None = None) -> Any:
            return reduce_scatterv(self, input_, dim, sizes)

        def reduce_scatter(self, input_: Any, dim: int = -1) -> Any:
            return reduce_scatterv(self, input_, dim, None)

        def batch_isend_irecv(self, p2p_ops: list) -> None:
            batch_isend_irecv(self, p2p_ops)

    return EepCpuCommunicator


def host_eplb_communicator(cpu_group: Any) -> Any:
    """An EPLB communicator over a (stateless) gloo process group: queued sends and receives of
    host tensors, run point to point with the group's own ``send``/``recv`` in ``execute``."""
    from vllm.distributed.eplb.eplb_communicator import EplbCommunicator

    class HostEplbCommunicator(EplbCommunicator):
        def __init__(self) -> None:
            self._group = cpu_group
            self._stream = None
            self._ops: list[tuple[bool, Any, int]] = []
            self._log_initialized()

        def add_send(self, tensors: list, dst_rank: int, expert_id: int) -> None:
            self._ops += [(True, t, dst_rank) for t in tensors]

        def add_recv(self, tensors: list, src_rank: int, expert_id: int) -> None:
            self._ops += [(False, t, src_rank) for t in tensors]

        def execute(self) -> None:
            ops, self._ops = self._ops, []
            works, staged = [], []
            for sending, tensor, peer in ops:
                buf = tensor.contiguous() if sending else tensor.new_empty(tensor.shape).contiguous()
                works.append(self._group.send([buf], peer, 0) if sending else self._group.recv([buf], peer, 0))
                if not sending:
                    staged.append((tensor, buf))
            for w in works:
                w.wait()
            for dst, buf in staged:
                dst.copy_(buf)

    return HostEplbCommunicator()
