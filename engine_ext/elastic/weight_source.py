"""Where expert weights come from when no live rank holds a copy (recovery after a death).

A ``WeightSource`` is what a checkpoint loader implements: the weights of one logical expert
of one layer, and the non-expert weights. The reference engine's ``SeededWeightSource``
re-creates them from its seed, exactly as the ranks initialised them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from engine_ext.engine.config import EngineConfig


class WeightSource(Protocol):
    """The model's weights, readable at any time by any rank."""

    def expert(self, layer: int, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) of logical expert ``logical`` in layer ``layer``."""

    def dense(self) -> dict[str, torch.Tensor]:
        """The non-expert weights, by name."""


class SeededWeightSource:
    """The reference engine's checkpoint: its seeded initialisation."""

    def __init__(self, cfg: EngineConfig, seed: int | None = None) -> None:
        self.cfg = cfg
        self.seed = cfg.seed if seed is None else seed

    def expert(self, layer: int, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
        from engine_ext.engine.model import expert_weights, torch_dtype

        return expert_weights(self.cfg, self.seed, layer, logical, torch_dtype(self.cfg.dtype))

    def dense(self) -> dict[str, torch.Tensor]:
        import torch

        from engine_ext.elastic.eplb import build_layout
        from engine_ext.engine.model import MoEModel

        layout = build_layout(self.cfg.num_experts, self.cfg.slots_per_rank,
                              -(-self.cfg.num_experts // self.cfg.slots_per_rank))
        return dict(MoEModel(self.cfg, layout, 0, torch.device("cpu"), self.seed).dense)
