"""The model's weights as a function of (config, seed): the serving model and the dense
oracle both build from here, so the oracle shares the checkpoint and nothing else."""

from __future__ import annotations

import math

import torch

from engine_ext.config import EngineConfig

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(g: torch.Generator, *shape: int, fan_in: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)).to(dtype)


def dense_weights(cfg: EngineConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Non-expert weights, in a fixed order: this order is what a weight transfer moves."""
    H, V = cfg.hidden_size, cfg.vocab_size
    g = _gen(seed)
    dt = dtype
    dense: dict[str, torch.Tensor] = {
        "embed": _rand(g, V, H, fan_in=1, dtype=dt) * 0.5,
        "pos_embed": _rand(g, cfg.max_model_len, H, fan_in=1, dtype=dt) * 0.1,
    }
    for layer in range(cfg.num_layers):
        dense[f"l{layer}.ln1"] = torch.ones(H, dtype=dt) + _rand(g, H, fan_in=100, dtype=dt)
        dense[f"l{layer}.wqkv"] = _rand(g, H, 3 * H, fan_in=H, dtype=dt)
        dense[f"l{layer}.wo"] = _rand(g, H, H, fan_in=H, dtype=dt)
        dense[f"l{layer}.ln2"] = torch.ones(H, dtype=dt) + _rand(g, H, fan_in=100, dtype=dt)
        dense[f"l{layer}.router"] = _rand(g, H, cfg.num_experts, fan_in=H, dtype=dt) * 4.0
    dense["final_norm"] = torch.ones(H, dtype=dt)
    dense["lm_head"] = _rand(g, H, V, fan_in=H, dtype=dt) * 4.0
    return dense


def expert_weights(
    cfg: EngineConfig, seed: int, layer: int, logical: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1, w2) of one logical expert in one layer."""
    g = _gen(seed * 1_000_003 + layer * 10_007 + logical + 1)
    w1 = _rand(g, cfg.hidden_size, cfg.expert_hidden, fan_in=cfg.hidden_size, dtype=dtype)
    w2 = _rand(g, cfg.expert_hidden, cfg.hidden_size, fan_in=cfg.expert_hidden, dtype=dtype)
    return w1, w2
