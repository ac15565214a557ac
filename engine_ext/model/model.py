"""A tiny decoder-only MoE transformer with a paged KV cache and expert parallelism.

Weights come from the seed, so every rank that loads "the checkpoint" agrees; a rank that
joins later starts from placeholder weights and must receive the real ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_ext.capture_memory import replica_table_width
from engine_ext.config import EngineConfig
from engine_ext.elastic.comm import StatelessGroup
from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.workspace import WorkspaceManager, bytes_for
from engine_ext.model.gathered import GatheredMoE, gathered_specs
from engine_ext.model.routed import RoutedMoE, routed_specs, row_bytes, worst_case
from engine_ext.model.weights import dense_weights, expert_weights, torch_dtype
from engine_ext.transport.p2p import shared_empty

PLACEHOLDER_SEED_OFFSET = 7_919_000


@dataclass
class Batch:
    """A flat batch of tokens, padded to a size the whole DP group agreed on.

    A token names its request slot; the model finds the slot's block table in its own
    per-slot state (``MoEModel.block_table``), as vLLM's Model Runner V2 does, so whatever
    writes a live slot's row changes what that request reads."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_slots: torch.Tensor  # [T] int64, the request slot of each token (padding: the null slot)
    valid: torch.Tensor  # [T] bool, False for padding

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class Bound:
    """The long-lived tensors one forward reads, taken when its plan is built. An eager step
    builds a plan per call, so it reads the current tensors; a capture builds one plan and every
    replay reads the tensors it was captured with, as a CUDA graph reads its captured addresses."""

    kv: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    dense: dict[str, torch.Tensor]
    replica_table: torch.Tensor
    replica_count: torch.Tensor
    block_table: torch.Tensor
    expert_load: torch.Tensor
    position: torch.Tensor  # 0-dim int64: the rank's EP position, read at replay (never a baked int)
    workspace: list[torch.Tensor] | None  # MoE views carved once (captures) or None (fetched per step)


class MoEModel:
    def __init__(self, cfg: EngineConfig, layout: ExpertLayout, rank: int, device: torch.device, seed: int) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = torch_dtype(cfg.dtype)
        self.rank = rank
        # The EP position the expert routing reads, as a device scalar written in place by
        # ``set_layout``: a capture reads it at replay, so a rank whose position changes (a standby
        # adopted, a survivor of a middle rank's retire) keeps its captures valid.
        self.position = torch.tensor(rank, dtype=torch.int64, device=device)
        self.layout = layout
        H = cfg.hidden_size
        dt = self.dtype
        # Non-expert weights, in a fixed order: this list is what a weight transfer moves.
        self.dense = dense_weights(cfg, seed, dt)
        for k in self.dense:
            self.dense[k] = self.dense[k].to(device)
        # Expert weights for this rank's physical slots: [layers][slots, ...], written in place.
        L = cfg.slots_per_rank
        # On CPU they live in memory the host's other ranks can map: an expert move reads them in place.
        alloc = (
            (lambda *shape: shared_empty(shape, dt))
            if device.type == "cpu"
            else (lambda *shape: torch.empty(*shape, dtype=dt, device=device))
        )
        self.w1 = alloc(cfg.num_layers, L, H, cfg.expert_hidden)
        self.w2 = alloc(cfg.num_layers, L, cfg.expert_hidden, H)
        for s, e in enumerate(layout.local_logical(rank)):
            for layer in range(cfg.num_layers):
                a, b = expert_weights(cfg, seed, layer, e, dt)
                self.w1[layer, s].copy_(a)
                self.w2[layer, s].copy_(b)
        self.kv = torch.zeros(
            cfg.num_layers, cfg.num_blocks * cfg.block_size, 2, cfg.num_heads, cfg.head_dim, dtype=dt, device=device
        )
        # Per-slot request state: the block table of the request in each slot; the last row is the
        # null slot (all null blocks) that padding tokens name.
        self.null_slot = cfg.max_num_seqs
        self.block_table = torch.zeros(cfg.max_num_seqs + 1, cfg.max_blocks_per_seq, dtype=torch.int64, device=device)
        # Expert load of the steps since the step loop last took it (vLLM's expert_load_view).
        self.expert_load = torch.zeros(cfg.num_experts, dtype=torch.int64, device=device)
        self._set_routing(layout)

    # ---- layout -------------------------------------------------------------------------
    def _set_routing(self, layout: ExpertLayout) -> None:
        self.layout = layout
        table, counts = layout.replica_table()
        width = replica_table_width(self.cfg)  # reuse: fixed storage, since reused captures read it
        if width and getattr(self, "replica_table", None) is not None and self.replica_table.shape[1] == width:
            t = torch.tensor(table, dtype=torch.int64, device=self.device)
            self.replica_table.zero_()[:, : t.shape[1]].copy_(t)
            self.replica_count.copy_(torch.tensor(counts, dtype=torch.int64, device=self.device))
            return
        self.replica_table = torch.tensor(table, dtype=torch.int64, device=self.device)
        if width:
            self.replica_table = torch.nn.functional.pad(self.replica_table, (0, width - self.replica_table.shape[1]))
        self.replica_count = torch.tensor(counts, dtype=torch.int64, device=self.device)

    def set_layout(self, layout: ExpertLayout, rank: int) -> None:
        self.rank = rank
        self.position.fill_(rank)  # in place: captures hold this tensor
        self._set_routing(layout)

    def expert_vector(self, slot: int) -> torch.Tensor:
        return torch.cat([self.w1[:, slot].reshape(-1), self.w2[:, slot].reshape(-1)])

    def load_expert_vector(self, slot: int, vec: torch.Tensor) -> None:
        n1 = self.w1[:, slot].numel()
        self.w1[:, slot].copy_(vec[:n1].view_as(self.w1[:, slot]))
        self.w2[:, slot].copy_(vec[n1:].view_as(self.w2[:, slot]))

    def set_slot_blocks(self, slot: int, blocks: list[int]) -> None:
        """Write a request slot's block table row (at admission), padded with the null block."""
        row = self.block_table[slot]
        row.zero_()
        if blocks:
            row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int64, device=self.device)

    def take_expert_load(self) -> list[int]:
        """The expert load recorded since the last call, and reset it."""
        load = self.expert_load.tolist()
        self.expert_load.zero_()
        return load

    def buffers(self) -> dict[str, torch.Tensor]:
        """Long-lived tensors a captured step reads; their storage must not change under it."""
        return {
            "kv": self.kv,
            "w1": self.w1,
            "w2": self.w2,
            "replica_table": self.replica_table,
            "replica_count": self.replica_count,
            "block_table": self.block_table,
            "expert_load": self.expert_load,
            "position": self.position,
            **{f"dense:{k}": v for k, v in self.dense.items()},
        }

    def bind(self, workspace_views: list[torch.Tensor] | None = None) -> Bound:
        return Bound(
            self.kv,
            self.w1,
            self.w2,
            dict(self.dense),
            self.replica_table,
            self.replica_count,
            self.block_table,
            self.expert_load,
            self.position,
            workspace_views,
        )

    # ---- workspace sizing ----------------------------------------------------------------
    def moe_workspace_bound(self, world_size: int) -> int:
        """Worst case over all routings at max_num_tokens, over both MoE paths: the routed path
        (every pair of every rank on one rank, ``engine_ext.model.routed``) and the gathered one
        that captured CUDA steps keep (every gathered token through every slot)."""
        cfg = self.cfg
        T = cfg.max_num_tokens
        routed = bytes_for(routed_specs(cfg, self.dtype, *worst_case(cfg, world_size, T)))
        return max(routed, bytes_for(gathered_specs(cfg, self.dtype, world_size * T, 1)))

    def exchange_bound(self, world_size: int) -> int:
        """Bytes one rank puts into the largest per-step collective of a ``world_size`` world: the
        routed combine's return of every pair it received (worst case: every pair of the world,
        ``routed.worst_case``) behind a 64-byte-aligned header of counts, or (the gathered path of
        captured CUDA steps) the reduce-scatter of the accumulator ([world x tokens, hidden]).
        Tokens: max_num_tokens or the largest capture."""
        cfg, item = self.cfg, self.dtype.itemsize
        tokens = max([cfg.max_num_tokens, *cfg.capture_sizes])
        received = worst_case(cfg, world_size, tokens)[1]
        routed = -(-world_size * 8 // 64) * 64 + received * row_bytes(cfg, self.dtype)
        return max(world_size * tokens * cfg.hidden_size * item, routed)

    # ---- forward ---------------------------------------------------------------------------
    # The forward pass is a plan: a list of steps, each either local compute or a collective.
    # Eager execution runs them in order; a CUDA-graph capture records each run of compute
    # steps as one graph and leaves the collectives (gloo cannot be captured) between them.
    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(
        self,
        batch: Batch,
        group: StatelessGroup | None,
        workspace: WorkspaceManager,
        *,
        dense_moe: bool = False,
        record_load: bool = True,
    ) -> torch.Tensor:
        """Logits for every token of ``batch``. ``group`` spans the EP world (None: one rank).
        The routing of valid tokens is added to ``expert_load`` unless ``record_load`` is False
        (warm-up: EPLB must not see dummy load)."""
        steps, ns = self.plan(batch, group, workspace, dense_moe=dense_moe, record_load=record_load)
        for _, fn in steps:
            fn()
        return ns["logits"]

    def plan(
        self,
        batch: Batch,
        group: StatelessGroup | None,
        workspace: WorkspaceManager,
        *,
        dense_moe: bool = False,
        record_load: bool = True,
        bind_workspace: bool = False,
    ) -> tuple[list[tuple[str, Callable[[], None]]], dict[str, torch.Tensor]]:
        """(steps, namespace): steps are ("compute" | "comm", fn); results land in the namespace.

        Every tensor the steps read is bound here (``Bound``); with ``bind_workspace`` (captures)
        the MoE workspace views are carved here too, so a replay reads what it was captured with.
        Collectives read and write only tensors a compute step allocated earlier, under a key
        unique to their layer: after a piecewise capture the compute steps never run in Python
        again, so an eager collective must find exactly the tensors its graphs were captured with.
        """
        cfg = self.cfg
        T = batch.num_tokens
        W = 1 if group is None else group.size
        N = W * T
        # The routed path (engine_ext.model.routed) serves eager steps and CPU captures; the
        # gathered, dense one stays for CUDA captures: its shapes do not depend on the routing.
        specs = (
            gathered_specs(cfg, self.dtype, N, 1)
            if dense_moe
            else routed_specs(cfg, self.dtype, *worst_case(cfg, W, T))
        )
        b = self.bind(workspace.get(specs) if bind_workspace else None)
        moe = (
            GatheredMoE(cfg, self.dtype, workspace, b, group)
            if dense_moe
            else RoutedMoE(cfg, self.dtype, workspace, b.workspace)
        )
        d = b.dense
        ns: dict[str, torch.Tensor] = {}
        steps: list[tuple[str, Callable[[], None]]] = []

        def start() -> None:
            bs = cfg.block_size
            ns["x"] = d["embed"][batch.token_ids] + d["pos_embed"][batch.positions]
            tables = b.block_table[batch.req_slots]  # [T, max_blocks]: read through the request slot
            ns["slot_mapping"] = (
                torch.gather(tables, 1, (batch.positions // bs).unsqueeze(1)).squeeze(1) * bs + batch.positions % bs
            )
            ns["ctx_slots"] = (tables.unsqueeze(-1) * bs + torch.arange(bs, device=self.device)).reshape(T, -1)
            ctx_pos = torch.arange(ns["ctx_slots"].shape[1], device=self.device)
            ns["mask"] = ctx_pos.unsqueeze(0) > batch.positions.unsqueeze(1)

        steps.append(("compute", start))
        for layer in range(cfg.num_layers):
            steps += self._layer_steps(layer, batch, ns, b, group, record_load, moe)

        def finish() -> None:
            ns["logits"] = self._rms(ns["x"], d["final_norm"]) @ d["lm_head"]

        steps.append(("compute", finish))
        return steps, ns

    def _layer_steps(
        self,
        layer: int,
        batch: Batch,
        ns: dict[str, torch.Tensor],
        b: Bound,
        group: StatelessGroup | None,
        record_load: bool,
        moe: RoutedMoE | GatheredMoE,
    ) -> list[tuple[str, Callable[[], None]]]:
        """One layer's steps: attention and routing, then the MoE exchange (routed or gathered)."""
        W = 1 if group is None else group.size
        steps: list[tuple[str, Callable[[], None]]] = [
            ("compute", lambda: self._attention_and_route(layer, batch, ns, b, record_load, moe, W))
        ]
        if isinstance(moe, RoutedMoE):
            if group is not None:
                steps.append(("comm", lambda: moe.dispatch(group, ns, layer)))
            steps.append(("compute", lambda: moe.experts(ns, layer, b.w1[layer], b.w2[layer], group)))
            if group is not None:
                steps.append(("comm", lambda: moe.combine(group, ns, layer)))
            steps.append(("compute", lambda: moe.residual(ns, layer)))
            return steps
        if group is not None:
            steps.append(("comm", lambda: moe.dispatch(ns, layer)))
        steps.append(("compute", lambda: moe.experts(ns, layer)))
        if group is not None:
            steps.append(("comm", lambda: moe.combine(ns, layer)))
        steps.append(("compute", lambda: moe.residual(ns, layer)))
        return steps

    def _attention_and_route(
        self,
        layer: int,
        batch: Batch,
        ns: dict[str, torch.Tensor],
        b: Bound,
        record_load: bool,
        moe: RoutedMoE | GatheredMoE,
        W: int,
    ) -> None:
        cfg, d = self.cfg, b.dense
        T, H, nh, hd, k = batch.num_tokens, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.top_k
        x = ns["x"]
        h = self._rms(x, d[f"l{layer}.ln1"])
        q, kk, v = (h @ d[f"l{layer}.wqkv"]).view(T, 3, nh, hd).unbind(1)
        cache = b.kv[layer]
        cache[ns["slot_mapping"], 0] = kk
        cache[ns["slot_mapping"], 1] = v
        keys = cache[ns["ctx_slots"], 0]  # [T, C, nh, hd]
        vals = cache[ns["ctx_slots"], 1]
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(hd)
        scores = scores.masked_fill(ns["mask"].unsqueeze(1), float("-inf"))
        attn = torch.einsum("thc,tchd->thd", torch.softmax(scores, dim=-1), vals).reshape(T, H)
        x = x + attn @ d[f"l{layer}.wo"]
        ns["x"] = x
        h = self._rms(x, d[f"l{layer}.ln2"])
        probs = torch.softmax(h @ d[f"l{layer}.router"], dim=-1)
        top_w, top_i = torch.topk(probs, k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        if record_load:  # EPLB statistics, recorded in the forward pass; shape-static and sync-free
            b.expert_load.scatter_add_(0, top_i.reshape(-1), batch.valid.to(torch.int64).repeat_interleave(k))
        if isinstance(moe, RoutedMoE):
            moe.route(ns, layer, h, top_i, top_w, batch.valid, b, W)
        else:
            moe.route(ns, layer, h, top_i, top_w)
