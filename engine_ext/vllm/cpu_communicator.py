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


def _build() -> type:
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    class EepCpuCommunicator(CpuCommunicator):
        """vLLM's CPU communicator plus variable-size gather/reduce-scatter and batched p2p."""

        def all_gatherv(self, input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
            if dim != 0:
                raise NotImplementedError("only dim 0 all-gatherv is supported")
            if isinstance(input_, (list, tuple)):
                return [self._gatherv(t, sizes) for t in input_]
            return self._gatherv(input_, sizes)

        def _gatherv(self, t: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
            world = self.world_size
            if world == 1:
                return t
            sizes = sizes if sizes is not None else [t.shape[0]] * world
            if len(sizes) != world or t.shape[0] != sizes[self.rank_in_group]:
                raise ValueError(f"rank {self.rank_in_group} holds {t.shape[0]} rows, sizes say {sizes}")
            most = max(sizes)
            padded = t.new_zeros((most,) + tuple(t.shape[1:]))
            padded[: t.shape[0]] = t
            out = t.new_empty((world * most,) + tuple(t.shape[1:]))
            dist.all_gather_into_tensor(out, padded.contiguous(), group=self.device_group)
            return torch.cat([out[r * most: r * most + n] for r, n in enumerate(sizes)])

        def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
            world = self.world_size
            if world == 1:
                return input_
            if dim < 0:
                dim += input_.dim()
            moved = input_.movedim(0, dim)
            chunks = _chunks(sizes, moved.shape[0], world)
            total = moved.to(torch.float32).contiguous()
            dist.all_reduce(total, group=self.device_group)
            start = sum(chunks[: self.rank_in_group])
            mine = total[start: start + chunks[self.rank_in_group]].to(input_.dtype)
            return mine.movedim(0, dim).contiguous()

        def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
            return self.reduce_scatterv(input_, dim, None)

        def batch_isend_irecv(self, p2p_ops: list) -> None:
            """Each op's peer is a rank of this group (vLLM passes group ranks). Stateless groups
            are not registered with torch, so ``P2POp``'s global-rank lookup fails on them: call
            ``isend``/``irecv`` with ``group_dst``/``group_src`` directly."""
            works = []
            for op in p2p_ops:  # vLLM builds some of them with object.__new__: read fields defensively
                peer = getattr(op, "group_peer", None)
                peer = peer if peer is not None else self.ranks.index(op.peer)
                group = getattr(op, "group", None) or self.device_group
                if op.op in (dist.isend, dist.send):
                    works.append(dist.isend(op.tensor, group=group, group_dst=peer))
                else:
                    works.append(dist.irecv(op.tensor, group=group, group_src=peer))
            for w in works:
                w.wait()

    return EepCpuCommunicator
