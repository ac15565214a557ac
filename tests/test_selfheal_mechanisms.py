"""Every self-healing mechanism is load-bearing: a fault variant switches one off (through the
one fault seam, engine_ext.faults), a serving rank is SIGKILLed with requests on it, and the
harm shows: requests lost or failed, or wrong tokens against the dense oracle.

The same scenario with the mechanism on is in tests/test_selfheal_local.py, which also shows
each mechanism's evidence (re-routed requests, degraded survivors, the new store host, the
experts restored from the weight source)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
from tests.engine_helpers import oracle_mismatch, run, wait_until

MAX_TOKENS = 24
PROMPTS = [[(13 * i + 7 * j + 1) % 256 for j in range(3 + i % 9)] for i in range(12)]
ANSWER_BOUND_S = 45.0  # far above a healthy recovery here (seconds): a request still open after it is lost

# variant -> (experts, start DP, victim). The victim holds requests when it is killed.
VARIANTS = {
    "no_reroute": (8, 3, 1),
    "no_degrade": (8, 3, 1),
    "no_store_rehost": (8, 3, 0),
    "no_weight_source_restore": (16, 4, 1),
}


def _cfg(variant: str) -> EngineConfig:
    experts = VARIANTS[variant][0]
    return EngineConfig(dtype="float64", num_experts=experts, slots_per_rank=6, faults=[variant])


async def _kill_under_load(dep: LocalDeployment, victim: int) -> tuple[list[asyncio.Task], set[asyncio.Task]]:
    """Submit every prompt, SIGKILL ``victim`` once it holds requests; the tasks answered within
    the bound, and those still open."""
    tasks = [asyncio.ensure_future(dep.generate(p, MAX_TOKENS)) for p in PROMPTS]
    await wait_until(lambda: dep.orch.router.inflight.get(victim, 0) > 0, 30, f"requests on rank {victim}")
    os.kill(dep.processes[victim].pid(), signal.SIGKILL)
    _, pending = await asyncio.wait(tasks, timeout=ANSWER_BOUND_S)
    return tasks, pending


@pytest.mark.timeout(200)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_self_healing_mechanism_removed_shows_harm(variant: str) -> None:
    experts, start, victim = VARIANTS[variant]
    cfg = _cfg(variant)
    reference = reference_generate(EngineConfig(dtype="float64", num_experts=experts, slots_per_rank=6),
                                   PROMPTS, MAX_TOKENS)

    async def scenario() -> None:
        async with LocalDeployment(cfg, f"harm-{variant}", max_dp=4, on_rank_failure="shrink") as dep:
            await dep.start(start)
            tasks, pending = await _kill_under_load(dep, victim)
            done = [(i, t.result()) for i, t in enumerate(tasks) if t not in pending]
            failed = [r["error"] for _, r in done if r.get("error")]
            if variant == "no_reroute":
                # the dead rank's requests stay owned by it: nobody ever answers them
                assert pending and not failed, (len(pending), failed)
                assert dep.orch.router.rerouted == 0
                return
            assert not pending, f"{len(pending)} request(s) unanswered"
            await dep.orch.recovery.wait()
            ops = [op for op in dep.orch.history if op.get("kind") == "recover"]
            if variant == "no_degrade":
                # the survivors take the peer's death for their own failure and fail their requests
                assert failed and all("peer" in e or "rank" in e for e in failed), failed
            elif variant == "no_store_rehost":
                # the survivors regroup on the dead rank's store: the recovery fails, and the requests
                assert ops and ops[-1]["state"] == "failed", ops
                assert failed, "requests failed with the recovery"
            else:  # no_weight_source_restore: the slot of the lost expert keeps another expert's weights
                assert ops and ops[-1]["state"] == "succeeded", ops
                again = await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS))
                assert "tokens" in oracle_mismatch(list(enumerate(again)), reference, logits=False)
    run(scenario(), 180)
