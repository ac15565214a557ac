"""The correctness oracle: a multi-process expert-parallel deployment (real gloo groups,
redundant experts, captured decode steps) produces exactly the greedy outputs of the
single-process reference run."""

from __future__ import annotations

import asyncio
import copy

import pytest

from engine_ext.engine.config import EngineConfig
from engine_ext.engine.launcher import LocalDeployment
from engine_ext.engine.oracle import reference_generate
from tests.engine_helpers import oracle_mismatch, run

MAX_TOKENS = 6

# Varied lengths (1..29 tokens) and contents, all inside the default vocab of 256.
PROMPTS = [
    [7],
    [1, 2, 3],
    [200, 13, 99, 5, 5],
    [(11 * j + 3) % 256 for j in range(9)],
    [(37 * j + 17) % 256 for j in range(14)],
    [255, 0, 128, 64, 32, 16, 8, 4, 2, 1, 0, 255],
    [(5 * j * j + 1) % 256 for j in range(21)],
    [(97 * j + 41) % 256 for j in range(29)],
]


def _cfg() -> EngineConfig:
    return EngineConfig(dtype="float64", slots_per_rank=6)


async def _serve(cfg: EngineConfig, dp: int, name: str) -> tuple[list[dict], object]:
    async with LocalDeployment(cfg, name, max_dp=4) as dep:
        await dep.start(dp)
        layout = dep.orch.layout
        results = await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS))
    return list(results), layout


def _mismatch(results: list[dict], ref: list[dict]) -> str:
    assert len(results) == len(ref)
    return oracle_mismatch(list(enumerate(results)), ref)


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return reference_generate(_cfg(), PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def served_dp2() -> tuple[list[dict], object]:
    return run(_serve(_cfg(), 2, "oracle2"), 150)


def _check_against_oracle(results, layout, dp, reference):
    assert layout.world_size == dp
    assert layout.num_redundant > 0, "the test must exercise redundant experts"
    assert layout.num_redundant == 6 * dp - 8
    assert any(len(layout.replicas(e)) > 1 for e in range(8))
    assert len(results) == len(PROMPTS)
    for i, res in enumerate(results):
        assert not res.get("error"), f"prompt {i} failed: {res.get('error')}"
        assert res["prompt"] == PROMPTS[i]
        assert len(res["output"]) == MAX_TOKENS and len(res["logits"]) == MAX_TOKENS
    # Requests were spread over the ranks, so EP really ran across processes.
    assert {res["rank"] for res in results} == set(range(dp))
    assert _mismatch(results, reference) == ""


@pytest.mark.timeout(180)
def test_oracle_dp2(served_dp2, reference):
    results, layout = served_dp2
    _check_against_oracle(results, layout, 2, reference)


@pytest.mark.timeout(180)
def test_oracle_dp3(reference):
    results, layout = run(_serve(_cfg(), 3, "oracle3"), 150)
    _check_against_oracle(results, layout, 3, reference)


@pytest.mark.timeout(180)
def test_oracle_detects_a_different_model(served_dp2, reference):
    """The comparison can fail: a reference built from another seed does not match."""
    results, _ = served_dp2
    other = copy.deepcopy(_cfg())
    other.seed += 1
    wrong = reference_generate(other, PROMPTS, MAX_TOKENS)
    assert _mismatch(results, wrong) != ""
    assert any(a["output"] != b["output"] for a, b in zip(results, wrong))
    # ... while the right seed matches the very same results.
    assert _mismatch(results, reference) == ""
