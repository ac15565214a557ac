"""Where expert weights come from when no live rank holds a copy (recovery after a death).

A ``WeightSource`` is what a checkpoint loader implements: the weights of one logical expert of
one layer, what a recovery restores. The reference model's ``SeededWeightSource``
(engine_ext.model.seeded_source) re-creates them from its seed; a rank is handed one
(``RankEngine(weight_source=...)``), so a real loader can be injected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class WeightSource(Protocol):
    """The model's weights, readable at any time by any rank."""

    def expert(self, layer: int, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) of logical expert ``logical`` in layer ``layer``."""
