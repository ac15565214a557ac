"""The gathered MoE path that captured CUDA steps keep: its shapes do not depend on the routing.

Per layer, over a world of ``W`` ranks with ``T`` tokens each (``N = W T`` gathered tokens):

  route     (compute) the layer's hidden states and routing, and the gathered buffers' views
            (from the workspace) under keys unique to the layer
  dispatch  (comm) one all-gather of hidden states, expert ids and routing weights
  experts   (compute) every local slot over every gathered token, weighted by the routing (zero
            where another rank's slot serves the pair), summed into the accumulator
  combine   (comm) the accumulator reduce-scattered back: each rank keeps its tokens' rows
  residual  (compute) ``x += moe_out``

One rank (no group): the "gathered" tensors are the local ones; experts copies them in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine_ext.config import EngineConfig
    from engine_ext.elastic.comm import StatelessGroup
    from engine_ext.elastic.workspace import WorkspaceManager


def gathered_specs(
    cfg: EngineConfig, dtype: torch.dtype, gathered_tokens: int, slot_tokens: int
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The gathered path's workspace."""
    k = cfg.top_k
    return [
        ((gathered_tokens, cfg.hidden_size), dtype),  # gathered hidden states
        ((gathered_tokens, k), torch.int64),  # gathered expert ids
        ((gathered_tokens, k), dtype),  # gathered routing weights
        ((gathered_tokens, cfg.hidden_size), dtype),  # combine accumulator
        ((slot_tokens, cfg.hidden_size), dtype),  # expert input rows
        ((slot_tokens, cfg.expert_hidden), dtype),  # expert intermediate
    ]


class GatheredMoE:
    """The gathered path of one forward plan over ``group`` (None: one rank); ``bound`` is the
    plan's ``Bound`` (weights, replica table, EP position, workspace views). Per-layer state lives
    in the plan's namespace."""

    def __init__(
        self,
        cfg: EngineConfig,
        dtype: torch.dtype,
        workspace: WorkspaceManager,
        bound: Any,
        group: StatelessGroup | None,
    ) -> None:
        self.cfg, self.dtype, self.workspace = cfg, dtype, workspace
        self.b, self.group = bound, group
        self.world = 1 if group is None else group.size

    def route(
        self, ns: dict[str, torch.Tensor], layer: int, h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor
    ) -> None:
        """Layer ``layer``'s hidden states and routing, and the gathered buffers' views: taken here so
        the collectives reuse them."""
        T, H = h.shape[0], self.cfg.hidden_size
        N = self.world * T
        b = self.b
        views = (
            b.workspace if b.workspace is not None else self.workspace.get(gathered_specs(self.cfg, self.dtype, N, 1))
        )
        gh, gi, gw, acc, _, _ = views
        ns.update(
            {
                f"h{layer}": h,
                f"top_w{layer}": top_w,
                f"top_i{layer}": top_i,
                f"gh{layer}": gh,
                f"gi{layer}": gi,
                f"gw{layer}": gw,
                f"acc{layer}": acc,
                f"moe_out{layer}": torch.empty(T, H, dtype=h.dtype, device=h.device),
            }
        )

    def dispatch(self, ns: dict[str, torch.Tensor], layer: int) -> None:
        W = self.world
        self.group.all_gather_many(  # type: ignore[union-attr]
            [
                (list(ns[f"{g}{layer}"].chunk(W)), ns[f"{x}{layer}"].contiguous())
                for g, x in (("gh", "h"), ("gi", "top_i"), ("gw", "top_w"))
            ]
        )

    def experts(self, ns: dict[str, torch.Tensor], layer: int) -> None:
        """Every local slot over every gathered token, weighted by the routing: shape-static."""
        b = self.b
        k, L = self.cfg.top_k, self.cfg.slots_per_rank
        N = self.world * ns[f"h{layer}"].shape[0]
        gh, gi, gw, acc = ns[f"gh{layer}"], ns[f"gi{layer}"], ns[f"gw{layer}"], ns[f"acc{layer}"]
        if N == ns[f"h{layer}"].shape[0]:  # one rank: the "gathered" tensors are the local ones
            gh.copy_(ns[f"h{layer}"])
            gi.copy_(ns[f"top_i{layer}"])
            gw.copy_(ns[f"top_w{layer}"])
        # Which physical replica serves each (token, choice): a fixed function of the gathered
        # token index, so every rank agrees without communicating.
        token_idx = torch.arange(N, device=gh.device).unsqueeze(1).expand(N, k)
        choice = token_idx % b.replica_count[gi]
        phys = torch.gather(b.replica_table[gi], 2, choice.unsqueeze(-1)).squeeze(-1)  # [N, k]
        local = (phys // L) == b.position
        local_slot = phys % L
        acc.zero_()
        for s in range(L):
            wsel = (gw * (local & (local_slot == s))).sum(-1, keepdim=True)  # [N, 1]
            y = torch.relu(gh @ b.w1[layer, s]) @ b.w2[layer, s]
            acc.add_(y * wsel)

    def combine(self, ns: dict[str, torch.Tensor], layer: int) -> None:
        group = self.group
        assert group is not None
        acc, out = ns[f"acc{layer}"], ns[f"moe_out{layer}"]
        if not group.reduce_scatters_on_device:
            # reduce_scatter of device tensors is not among gloo's CUDA collectives: all-reduce
            # the accumulator and keep this rank's chunk.
            group.all_reduce_sum(acc)
            out.copy_(acc.chunk(self.world)[group.rank])
        else:
            group.reduce_scatter(out, list(acc.chunk(self.world)))

    def residual(self, ns: dict[str, torch.Tensor], layer: int) -> None:
        T = ns[f"h{layer}"].shape[0]
        out = ns[f"acc{layer}"][:T] if self.group is None else ns[f"moe_out{layer}"]
        ns["x"] = ns["x"] + out
