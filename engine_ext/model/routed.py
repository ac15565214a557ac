"""Routed MoE dispatch and combine: each (token, expert) pair travels only to the rank that holds
the expert slot serving it, and its expert output only back (an all-to-all of routed pairs).

The all-gather it replaces sent every rank's padded batch to every rank and ran each rank's
experts over all of it. Here, per layer:

  route     (compute) each valid token's k choices -> physical slot (replica choice: global token
            index modulo the expert's replica count, as before) -> a row [slot id | hidden state] in
            the send buffer, rows ordered by destination rank; rows per destination counted
  dispatch  (comm) ``all_to_all_v``: the counts, then the rows; received rows land in rank order
  experts   (compute) each local slot runs on its received rows; its output overwrites the row's
            hidden state in place (the row was copied out before)
  combine   (comm) ``all_to_all_v`` back, the counts known from the dispatch; returned rows land in
            the send buffer (no longer needed), in the order they were sent
  residual  (compute) ``x += sum_k gate_k * y_k``, in the send order

Workspace (one rank, ``T`` tokens a step, world ``W``, ``k`` = top_k, ``L`` slots per rank;
``row`` = 8 + hidden x dtype bytes, rounded up to 8): send ``T k`` rows, receive ``R`` rows,
expert input and intermediate of one slot ``S`` rows. The worst case over routings is every pair
of every rank routed to one rank: ``R = W T min(k, L)`` (a token's k choices are distinct experts,
so at most ``min(k, L)`` of them on one rank) and ``S = W T`` (at most one pair per token on one
slot). ``routed_specs`` lists the buffers, ``MoEModel.moe_workspace_bound`` sizes them at
``T = max_num_tokens``. Padding tokens send nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine_ext.config import EngineConfig
    from engine_ext.elastic.workspace import WorkspaceManager

ID_BYTES = 8  # the slot id (int64) at the head of each row


def row_bytes(cfg: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of one routed row: the slot id, then the hidden state (a multiple of 8, so both views hold)."""
    return ID_BYTES + -(-cfg.hidden_size * dtype.itemsize // 8) * 8


def routed_specs(
    cfg: EngineConfig, dtype: torch.dtype, sent: int, received: int, slot_rows: int
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The routed path's workspace: send rows (then the returned outputs), received rows (then the
    outputs sent back), one slot's expert input and intermediate."""
    rb = row_bytes(cfg, dtype)
    return [
        ((sent, rb), torch.uint8),
        ((received, rb), torch.uint8),
        ((slot_rows, cfg.hidden_size), dtype),
        ((slot_rows, cfg.expert_hidden), dtype),
    ]


def worst_case(cfg: EngineConfig, world: int, tokens: int) -> tuple[int, int, int]:
    """(sent, received, slot rows) when every pair of every rank goes to one rank's slots."""
    return tokens * cfg.top_k, world * tokens * min(cfg.top_k, cfg.slots_per_rank), world * tokens


def hidden_of(rows: torch.Tensor, cfg: EngineConfig, dtype: torch.dtype) -> torch.Tensor:
    """The hidden-state part of routed rows, as ``dtype`` ([n, hidden])."""
    return rows[:, ID_BYTES : ID_BYTES + cfg.hidden_size * dtype.itemsize].view(dtype)


def slot_of(rows: torch.Tensor) -> torch.Tensor:
    """The slot-id part of routed rows ([n])."""
    return rows[:, :ID_BYTES].view(torch.int64)[:, 0]


class RoutedMoE:
    """The routed path of one forward plan: per-layer state lives in the plan's namespace."""

    def __init__(
        self, cfg: EngineConfig, dtype: torch.dtype, workspace: WorkspaceManager, bound: list[torch.Tensor] | None
    ) -> None:
        self.cfg, self.dtype, self.workspace = cfg, dtype, workspace
        self.bound = bound  # views carved once (captures: worst case for the capture's size) or None

    def _views(self, sent: int, received: int, slot_rows: int) -> list[torch.Tensor]:
        if self.bound is not None:
            return self.bound
        # Sized by this step; a larger later request may grow the buffer while unlocked (earlier
        # parts keep their offsets and contents), the bound covers the worst case.
        return self.workspace.get(routed_specs(self.cfg, self.dtype, sent, received, slot_rows))

    def route(
        self,
        ns: dict[str, Any],
        layer: int,
        h: torch.Tensor,
        top_i: torch.Tensor,
        top_w: torch.Tensor,
        valid: torch.Tensor,
        b: Any,
        world: int,
    ) -> None:
        """Build the send rows of layer ``layer``: valid tokens' pairs, ordered by destination rank."""
        cfg = self.cfg
        T, k, L = h.shape[0], cfg.top_k, cfg.slots_per_rank
        token_idx = (b.position * T + torch.arange(T, device=h.device)).unsqueeze(1).expand(T, k)
        choice = token_idx % b.replica_count[top_i]
        phys = torch.gather(b.replica_table[top_i], 2, choice.unsqueeze(-1)).squeeze(-1).reshape(-1)  # [T k]
        keep = torch.nonzero(valid.repeat_interleave(k), as_tuple=True)[0]
        dest = phys[keep] // L
        order = keep[torch.argsort(dest, stable=True)]
        counts = torch.bincount(dest, minlength=world).tolist()
        P = order.shape[0]
        send = self._views(P, 0, 1)[0][:P]
        slot_of(send).copy_(phys[order] % L)
        hidden_of(send, cfg, self.dtype).copy_(h[order // k])
        ns.update(
            {
                f"send{layer}": send,
                f"counts{layer}": counts,
                f"tok{layer}": order // k,
                f"gate{layer}": top_w.reshape(-1)[order],
            }
        )

    def dispatch(self, group: Any, ns: dict[str, Any], layer: int) -> None:
        P = ns[f"send{layer}"].shape[0]
        ns[f"recv_counts{layer}"] = group.all_to_all_v(
            ns[f"send{layer}"], ns[f"counts{layer}"], lambda n: self._views(P, n, 1)[1][:n]
        )

    def experts(self, ns: dict[str, Any], layer: int, w1: torch.Tensor, w2: torch.Tensor, group: Any) -> None:
        """Each local slot on its received rows; outputs overwrite the rows' hidden states."""
        cfg = self.cfg
        P = ns[f"send{layer}"].shape[0]
        R = P if group is None else sum(ns[f"recv_counts{layer}"])  # one rank: it receives what it sends
        first = self._views(P, R, 1)
        per_slot = torch.bincount(
            slot_of(first[0][:P] if group is None else first[1][:R]), minlength=cfg.slots_per_rank
        ).tolist()
        views = self._views(P, R, max(per_slot + [1]))  # the buffer may grow: re-read through new views
        ns[f"send{layer}"] = views[0][:P]
        ns[f"recv{layer}"] = recv = views[0][:P] if group is None else views[1][:R]
        slots = slot_of(recv)
        x = hidden_of(recv, cfg, self.dtype)
        xin, mid = views[2], views[3]
        for s, n in enumerate(per_slot):
            if n == 0:
                continue
            rows = torch.nonzero(slots == s, as_tuple=True)[0]
            xs, ms = xin[:n], mid[:n]
            torch.index_select(x, 0, rows, out=xs)
            torch.matmul(xs, w1[s], out=ms)
            ms.relu_()
            x.index_copy_(0, rows, ms @ w2[s])

    def combine(self, group: Any, ns: dict[str, Any], layer: int) -> None:
        send = ns[f"send{layer}"]
        group.all_to_all_v(ns[f"recv{layer}"], ns[f"recv_counts{layer}"], lambda n: send[:n], ns[f"counts{layer}"])

    def residual(self, ns: dict[str, Any], layer: int) -> None:
        """``x += sum over pairs of gate x expert output``, accumulated in the send order."""
        y = hidden_of(ns[f"send{layer}"], self.cfg, self.dtype)
        out = torch.zeros_like(ns["x"])
        out.index_add_(0, ns[f"tok{layer}"], y * ns[f"gate{layer}"].unsqueeze(-1))
        ns["x"] = ns["x"] + out
