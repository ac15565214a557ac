"""The correctness oracle: a multi-process expert-parallel deployment (real gloo groups,
redundant experts, captured decode steps, paged KV) produces the greedy tokens of the dense
recompute (engine_ext.model.dense_oracle), logits within a float tolerance, at every DP size
from 1 to 4 and for a sharded config (16 experts, 6 slots per rank), on either transport of the
per-step collectives: shared memory (``auto``, the default; all ranks share this host) and gloo."""

from __future__ import annotations

import asyncio
import copy

import pytest

from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
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


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(dtype="float64", **kw)


async def _serve_sizes(cfg: EngineConfig, sizes: list[int], name: str) -> dict[int, tuple[list[dict], object]]:
    """Start at sizes[0], then scale through the rest; the prompts' results and layout at each size."""
    out: dict[int, tuple[list[dict], object]] = {}
    async with LocalDeployment(cfg, name, max_dp=4) as dep:
        for i, dp in enumerate(sizes):
            if i == 0:
                await dep.start(dp)
            else:
                op = await dep.scale(dp, timeout_s=120)
                assert op["state"] == "succeeded", (op.get("error"), op.get("phase_durations"), op.get("rank_states"))
                # the new world's transport, chosen in prepare: what this run compares
                kinds = {
                    e["detail"].get("transport")
                    for e in dep.registry.events_for(op["op_id"])
                    if e["phase"] == "prepare" and e["rank"] >= 0
                }
                assert kinds == {"shm" if cfg.transport == "auto" else "gloo"}, kinds
            results = await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS))
            out[dp] = (list(results), dep.orch.layout)
    return out


def _mismatch(results: list[dict], ref: list[dict]) -> str:
    assert len(results) == len(ref)
    return oracle_mismatch(list(enumerate(results)), ref)


def _check(results, layout, dp, experts, slots, reference) -> None:
    assert layout.world_size == dp
    assert layout.num_redundant == slots * dp - experts
    assert len(results) == len(PROMPTS)
    for i, res in enumerate(results):
        assert not res.get("error"), f"prompt {i} failed: {res.get('error')}"
        assert res["prompt"] == PROMPTS[i]
        assert len(res["output"]) == MAX_TOKENS and len(res["logits"]) == MAX_TOKENS
    # Requests were spread over the ranks, so EP really ran across processes.
    assert {res["rank"] for res in results} == set(range(dp))
    assert _mismatch(results, reference) == ""


TRANSPORTS = ["auto", "gloo"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def served_8x8(request: pytest.FixtureRequest) -> dict[int, tuple[list[dict], object]]:
    return run(
        _serve_sizes(_cfg(slots_per_rank=8, transport=request.param), [1, 2, 3, 4], f"oracle8-{request.param}"), 240
    )


@pytest.mark.timeout(270)
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_dense_oracle_equals_serving_at_dp(served_8x8, dp):
    results, layout = served_8x8[dp]
    _check(results, layout, dp, 8, 8, reference_generate(_cfg(slots_per_rank=8), PROMPTS, MAX_TOKENS))
    if dp > 1:
        assert any(len(layout.replicas(e)) > 1 for e in range(8)), "redundant experts must be exercised"


@pytest.mark.timeout(270)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dense_oracle_equals_sharded_serving(transport):
    """16 experts on 6 slots per rank: no rank holds every expert, so EP dispatch is load-bearing."""
    cfg = _cfg(num_experts=16, slots_per_rank=6, transport=transport)
    served = run(_serve_sizes(cfg, [3, 4], f"oracle16-{transport}"), 240)
    reference = reference_generate(cfg, PROMPTS, MAX_TOKENS)
    for dp, (results, layout) in served.items():
        assert all(len(layout.local_logical(r)) < 16 for r in range(dp))
        _check(results, layout, dp, 16, 6, reference)


@pytest.mark.timeout(270)
def test_oracle_detects_a_different_model(served_8x8):
    """The comparison can fail: a reference built from another seed does not match."""
    results, _ = served_8x8[2]
    other = copy.deepcopy(_cfg(slots_per_rank=8))
    other.seed += 1
    wrong = reference_generate(other, PROMPTS, MAX_TOKENS)
    assert _mismatch(results, wrong) != ""
    assert any(a["output"] != b["output"] for a, b in zip(results, wrong))
    assert _mismatch(results, reference_generate(_cfg(slots_per_rank=8), PROMPTS, MAX_TOKENS)) == ""
