"""The all-to-all of routed rows over a gloo process group (``ProcessGroupGloo.alltoall_base``
takes uneven split sizes on CPU tensors; device tensors are staged through host memory)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def gloo_all_to_all_v(
    pg: dist.ProcessGroup,
    send: torch.Tensor,
    send_counts: list[int],
    recv_alloc: Callable[[int], torch.Tensor],
    recv_counts: list[int] | None,
) -> list[int]:
    """Counts first (one int64 per peer, unless the caller knows them), then the rows."""
    if recv_counts is None:
        mine = torch.tensor(send_counts, dtype=torch.int64)
        theirs = torch.empty_like(mine)
        pg.alltoall_base(theirs, mine, [], [], dist.AllToAllOptions()).wait()
        recv_counts = theirs.tolist()
    recv = recv_alloc(sum(recv_counts))
    staged = send.device.type != "cpu"
    src = send.cpu() if staged else send.contiguous()
    dst = torch.empty(recv.shape, dtype=recv.dtype) if staged else recv
    pg.alltoall_base(dst, src, list(recv_counts), list(send_counts), dist.AllToAllOptions()).wait()
    if staged:
        recv.copy_(dst)
    return list(recv_counts)
