"""The correctness oracle: the same model in one process, no expert parallelism, no graphs."""

from __future__ import annotations

import copy
from typing import Any

from engine_ext.elastic.eplb import build_layout
from engine_ext.engine.config import EngineConfig
from engine_ext.engine.rank import RankEngine


def reference_generate(cfg: EngineConfig, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Greedy outputs (tokens and chosen-token logits) of an unscaled single-process run."""
    single = copy.deepcopy(cfg)
    single.slots_per_rank = cfg.num_experts
    single.faults = []
    engine = RankEngine(single, "oracle", 0, build_layout(cfg.num_experts, cfg.num_experts, 1))
    for i, p in enumerate(prompts):
        engine.add_request({"request_id": str(i), "prompt": p, "max_tokens": max_tokens})
    done: dict[str, dict[str, Any]] = {}
    while engine.sched.has_work:
        items = engine.sched.schedule()
        n = sum(len(it.feed) for it in items)
        logits = engine.model.forward(engine.loop.batch(items, n), None, engine.workspace)
        for res in engine.loop.apply_logits(items, logits):
            done[res["request_id"]] = res
    return [done[str(i)] for i in range(len(prompts))]
