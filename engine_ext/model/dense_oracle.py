"""The independent correctness oracle: a dense recompute in plain PyTorch.

It shares only the config and the weights (engine_ext.model.weights) with the serving
engine: no KV cache, no paging, no scheduler, no request slots, no expert placement. Every
step recomputes full causal attention over the whole sequence, and every expert runs on every
token, mixed by the router's renormalised top-k weights. A bug in the engine's attention,
paging, routing or scheduling therefore shows as a mismatch instead of cancelling out.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine_ext.config import EngineConfig
from engine_ext.model.weights import dense_weights, expert_weights, torch_dtype


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class DenseOracle:
    """The model of ``cfg`` as one dense function of a token sequence."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        dt = torch_dtype(cfg.dtype)
        self.w = dense_weights(cfg, cfg.seed, dt)
        # [layers][experts] stacked: every expert of every layer, logical order.
        self.w1 = torch.stack(
            [
                torch.stack([expert_weights(cfg, cfg.seed, layer, e, dt)[0] for e in range(cfg.num_experts)])
                for layer in range(cfg.num_layers)
            ]
        )
        self.w2 = torch.stack(
            [
                torch.stack([expert_weights(cfg, cfg.seed, layer, e, dt)[1] for e in range(cfg.num_experts)])
                for layer in range(cfg.num_layers)
            ]
        )

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits at every position of ``tokens`` ([S, vocab])."""
        cfg, w = self.cfg, self.w
        S, H, nh = len(tokens), cfg.hidden_size, cfg.num_heads
        hd = H // nh
        ids = torch.tensor(tokens, dtype=torch.int64)
        x = w["embed"][ids] + w["pos_embed"][:S]
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)
        for layer in range(cfg.num_layers):
            h = _rms(x, w[f"l{layer}.ln1"])
            q, k, v = (h @ w[f"l{layer}.wqkv"]).view(S, 3, nh, hd).unbind(1)
            scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(hd)
            scores = scores.masked_fill(causal, float("-inf"))
            attn = torch.einsum("hst,thd->shd", torch.softmax(scores, dim=-1), v).reshape(S, H)
            x = x + attn @ w[f"l{layer}.wo"]
            h = _rms(x, w[f"l{layer}.ln2"])
            probs = torch.softmax(h @ w[f"l{layer}.router"], dim=-1)
            top_w, top_i = torch.topk(probs, cfg.top_k, dim=-1)
            mix = torch.zeros_like(probs).scatter(1, top_i, top_w / top_w.sum(-1, keepdim=True))  # [S, E]
            every = torch.einsum(
                "seh,eho->seo", torch.relu(torch.einsum("sh,ehi->sei", h, self.w1[layer])), self.w2[layer]
            )
            x = x + torch.einsum("se,seo->so", mix, every)
        return _rms(x, w["final_norm"]) @ w["lm_head"]

    def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """Greedy decoding, recomputing the whole sequence for every new token."""
        tokens = list(prompt)
        output: list[int] = []
        logits: list[float] = []
        for _ in range(max_tokens):
            last = self.logits(tokens)[-1]
            tok = int(torch.argmax(last))
            output.append(tok)
            logits.append(float(last[tok]))
            tokens.append(tok)
        return {"prompt": list(prompt), "output": output, "logits": logits}


def reference_generate(cfg: EngineConfig, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Greedy outputs (tokens and chosen-token logits) of the dense oracle, one per prompt."""
    oracle = DenseOracle(cfg)
    with torch.no_grad():
        return [oracle.generate(p, max_tokens) for p in prompts]
