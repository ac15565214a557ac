"""The reference model's checkpoint: its seeded initialisation, as a ``WeightSource``."""

from __future__ import annotations

import torch

from engine_ext.config import EngineConfig
from engine_ext.model.model import expert_weights, torch_dtype


class SeededWeightSource:
    """The reference engine's checkpoint: its seeded initialisation."""

    def __init__(self, cfg: EngineConfig, seed: int | None = None) -> None:
        self.cfg = cfg
        self.seed = cfg.seed if seed is None else seed

    def expert(self, layer: int, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
        return expert_weights(self.cfg, self.seed, layer, logical, torch_dtype(self.cfg.dtype))
