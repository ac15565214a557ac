"""A small random Mixtral checkpoint (config.json + model.safetensors) for vLLM correctness tests.

vLLM's dummy weights come from one fixed seed on every rank, so a rank that computes with the
wrong expert, or receives nothing, still produces the same tokens. Random weights written to a
real checkpoint and loaded by every rank make such errors change the output. Expert weights are
scaled apart from each other so that routing decides the output, and the LM head is large enough
that greedy argmax does not sit on a near tie.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_MIXTRAL: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 128,
    "num_attention_heads": 2,
    "head_dim": 64,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": None,
}


def write_random_mixtral(directory: Path, seed: int = 1234, **overrides: Any) -> Path:
    """Write config.json and model.safetensors of a random Mixtral into ``directory``."""
    import torch
    from safetensors.torch import save_file

    cfg = dict(TINY_MIXTRAL, **overrides)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    h, inter, heads, kv, hd = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], h, scale=h**0.5),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rand(cfg["vocab_size"], h, scale=8.0),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(heads * hd, h),
            p + "self_attn.k_proj.weight": rand(kv * hd, h),
            p + "self_attn.v_proj.weight": rand(kv * hd, h),
            p + "self_attn.o_proj.weight": rand(h, heads * hd),
            p + "block_sparse_moe.gate.weight": rand(cfg["num_local_experts"], h, scale=4.0),
        }
        for e in range(cfg["num_local_experts"]):
            q = f"{p}block_sparse_moe.experts.{e}."
            scale = 1.0 + e  # experts differ in size, so a wrong expert changes the sum
            tensors |= {
                q + "w1.weight": rand(inter, h, scale=scale),
                q + "w3.weight": rand(inter, h, scale=scale),
                q + "w2.weight": rand(h, inter, scale=scale),
            }
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    return directory
