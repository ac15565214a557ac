"""Ingresses apart from the controller (issue 33) on a real local Ray cluster: requests enter an
ingress actor, which owns them; the controller only tells it the world. A rank that dies while no
controller is up (the controller SIGSTOPped, then SIGKILLed) has its requests kept in the ingress
and served, continued with their streamed tokens, once the restarted controller recovered. The
HTTP API with real clients: curl and the `openai` package, behind the deployment's API key.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.helpers import (
    NAMESPACE,
    ROOT,
    SMALL_ENGINE,
    controller_pid,
    finish_load,
    moved_off,
    operations,
    oracle,
    pid_of,
    serving_ranks,
    status,
    wait_for,
    wait_held,
)

pytestmark = pytest.mark.ray

API_KEY = "eepkey-" + "0c9d2b7e4f6a8c1d3e5f7a9b"


def _up(
    name: str,
    dp: int,
    *,
    faults: list[str] | None = None,
    delay_s: float = 5.0,
    api_key: str | None = None,
    ingress: int = 1,
    host: str = "0.0.0.0",
    port: int = 0,
) -> dict[str, Any]:
    from eepctl import core

    engine = dict(SMALL_ENGINE, faults=faults or [], fault_delay_s=delay_s, step_timeout_s=4.0)
    core.up(
        core.Target(name=name, namespace=NAMESPACE),
        dp=dp,
        max_dp=dp,
        engine=engine,
        cpus_per_rank=1.0,
        gpus_per_rank=0.0,
        timeout_s=300,
        on_rank_failure="shrink",
        health_deadline_s=4.0,
        api_key=api_key,
        ingress=ingress,
        host=host,
        port=port,
    )
    return serving_ranks(name, list(range(dp)))


def _ingress_stats(name: str, index: int = 0) -> dict[str, Any]:
    import ray
    from engine_ext.ray.names import ingress_name

    return ray.get(ray.get_actor(ingress_name(name, index), namespace=NAMESPACE).stats.remote(), timeout=30)


@pytest.mark.timeout(300)
def test_a_rank_that_dies_while_no_controller_is_up_is_served_after_the_restart(deployments, ray_cluster):
    """DP 2 under 4 requests/s; rank 1 holds requests mid-decode; the controller is SIGSTOPped
    (no controller: Ray sees it alive and restarts nothing) and rank 1 SIGKILLed. Nothing
    recovers, and the ingress keeps the dead rank's requests and the new ones that no rank took;
    then the controller is SIGKILLed: Ray restarts it, it takes over, finds rank 1 gone and
    recovers; every request is served, equal to the oracle, those of rank 1 continued with the
    tokens it had streamed."""
    from eepctl import cluster

    cluster.connect(ray_cluster["address"], NAMESPACE)
    d = deployments("ing-noctl")
    snap = _up(d.name, 2, faults=["hold:step@1"], delay_s=3.0)
    cfg_d = snap["info"]["config"]
    load = d.popen("generate", "--name", d.name, "--rate", "4", "--duration", "14", "--max-tokens", "16", "-o", "json")
    wait_held(d.name, 1, "step", timeout=120)
    ctl = controller_pid(d.name)
    os.kill(ctl, signal.SIGSTOP)  # this test's own deployment's controller actor: no controller from here
    try:
        os.kill(pid_of(snap, 1), signal.SIGKILL)  # the rank actor of this test's own deployment
        t_kill = time.time()
        held = wait_for(
            lambda: (s := _ingress_stats(d.name))["inflight"] + s["parked"] > 0 and s,
            timeout=30,
            interval=0.3,
            what="the ingress holding requests",
        )
        time.sleep(3.0)  # a while with no controller: nothing may recover, nothing may fail
        assert not [o for o in operations(d.name, "recover") if o["started"] > t_kill - 1]
        assert _ingress_stats(d.name)["failed"] == 0, held
    finally:
        os.kill(ctl, signal.SIGKILL)  # stopped, it dies at once; Ray restarts it
    serving_ranks(d.name, [0], timeout=120)
    res = finish_load(load, cfg_d, 16, stop=True)  # every request answered, equal to the oracle
    moved_off(res["records"], 1)  # continued with the tokens rank 1 had streamed
    recovers = operations(d.name, "recover")
    assert recovers[-1]["dead_ranks"] == [1] and recovers[-1]["state"] == "succeeded", recovers
    assert status(d.name)["info"]["control"]["controller_restarts"] == 1
    print(
        f"\n[ingress] held {held['inflight']} in flight + {held['parked']} parked with no controller; "
        f"{res['completed']} of {len(res['records'])} served"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _actors_of(name: str) -> list[str]:
    """The deployment's actors in Ray's actor table (named ones: every actor it creates is)."""
    import ray
    from engine_ext.ray.names import controller_name, is_rank_actor, registry_name

    mine = (registry_name(name), controller_name(name))
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE
        and (a["name"] in mine or is_rank_actor(name, a["name"]) or a["name"].startswith(f"eep-ingress.{name}."))
    )


def _a_taken_port_fails_up_and_leaves_nothing(name: str, port: int, address: str) -> None:
    """`eepctl up --port P` while a socket of this test listens on P: exit 4, one line naming
    the port, and nothing of the deployment is left (Ray's actor table, the saved port), so the
    next `up` of that name is not refused as "already exists"."""
    from eepctl import cluster
    from engine_ext.ray.ingress_listen import saved_port
    from tests.helpers import eepctl

    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        res = eepctl(
            "up",
            "--dp",
            "1",
            "--name",
            name,
            "--namespace",
            NAMESPACE,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            timeout=240,
        )
    assert res.returncode == 4 and res.stdout == "" and "Traceback" not in res.stderr, res
    assert res.stderr.splitlines() == [
        f"eepctl: ingress 0 of {name!r}: cannot listen on 127.0.0.1:{port}: Address already in use"
    ], res.stderr
    cluster.connect(address, NAMESPACE)
    assert _actors_of(name) == [] and saved_port(NAMESPACE, name, 0) == 0


def _curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args], capture_output=True, text=True, timeout=120)


def _body_and_code(res: subprocess.CompletedProcess) -> tuple[str, int]:
    body, _, code = res.stdout.rpartition("\n")
    return body, int(code)


@pytest.mark.timeout(300)
def test_http_api_with_curl_and_the_openai_client(deployments, ray_cluster):
    """The ingress's OpenAI-compatible API behind the deployment's API key: curl and the openai
    package get completions (token-id prompts) equal to the oracle, whole and streamed as
    server-sent events; models, health and metrics answer; a wrong key is refused (401), bad
    input is a 400 in OpenAI's error shape; `eepctl status` shows the URL. Its port pinned with
    `--host 127.0.0.1 --port P`: the first `up` finds P taken and leaves nothing, the second serves
    there; P given as a Ray address is named an ingress, at once."""
    import openai

    d = deployments("ing-http")
    port = _free_port()
    _a_taken_port_fails_up_and_leaves_nothing(d.name, port, ray_cluster["address"])
    snap = _up(d.name, 2, api_key=API_KEY, host="127.0.0.1", port=port)  # the same name and port, free now
    cfg_d = snap["info"]["config"]
    url = snap["info"]["ingress"][0]["url"]
    assert url == f"http://127.0.0.1:{port}", snap["info"]["ingress"]
    from tests.helpers import eepctl

    table = eepctl("status", "--name", d.name, timeout=60).stdout
    assert f"ingress 0: {url}\n" in table, table  # a key: no "no key" warning
    wrong = eepctl("status", "--name", d.name, "--address", f"127.0.0.1:{port}", timeout=60)
    assert wrong.returncode == 3 and wrong.stdout == "" and len(wrong.stderr.splitlines()) == 1, wrong
    assert f"no Ray cluster answers at 127.0.0.1:{port}; that port answers HTTP: it is an ingress" in wrong.stderr
    auth = ("-H", f"Authorization: Bearer {API_KEY}")
    prompt = [3, 1, 4, 1, 5]
    want = oracle(cfg_d, prompt, 8)

    body, code = _body_and_code(_curl(f"{url}/health"))  # open, as vLLM's
    assert code == 200 and json.loads(body)["members"] == [0, 1], body
    body, code = _body_and_code(_curl(f"{url}/v1/models"))
    assert code == 401 and json.loads(body)["error"]["type"] == "invalid_api_key", body
    body, code = _body_and_code(_curl(*auth[:1], "Authorization: Bearer wrong", f"{url}/v1/models"))
    assert code == 401, body
    body, code = _body_and_code(_curl(*auth, f"{url}/v1/models"))
    assert code == 200 and json.loads(body)["data"][0]["id"] == d.name, body

    req = {"model": d.name, "prompt": prompt, "max_tokens": 8}
    body, code = _body_and_code(
        _curl(*auth, "-H", "Content-Type: application/json", "-d", json.dumps(req), f"{url}/v1/completions")
    )
    assert code == 200, body
    out = json.loads(body)
    assert out["choices"][0]["token_ids"] == want and out["usage"]["completion_tokens"] == 8, out
    res = _curl(
        "-N",
        *auth,
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps(dict(req, stream=True)),
        f"{url}/v1/completions",
    )
    events = [ln[len("data: ") :] for ln in res.stdout.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", res.stdout
    streamed = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
    assert streamed == want and len(events) >= 3, events  # token by token as the rank streams them
    body, code = _body_and_code(
        _curl(
            *auth,
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(dict(req, prompt="a string")),
            f"{url}/v1/completions",
        )
    )
    assert code == 400 and "token ids" in json.loads(body)["error"]["message"], body
    _input_the_model_cannot_serve_is_refused_at_once(d.name, url, auth, ray_cluster["address"])
    body, code = _body_and_code(_curl(*auth, f"{url}/metrics"))
    assert (
        code == 200 and f'eep_ingress_requests_total{{deployment="{d.name}",ingress="0",outcome="completed"}} ' in body
    ), body

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    prompts = [[2, 7, 1, 8], [1, 4, 1, 4, 2]]
    done = client.completions.create(model=d.name, prompt=prompts, max_tokens=8)
    assert [c.model_extra["token_ids"] for c in done.choices] == [oracle(cfg_d, p, 8) for p in prompts], done
    got: list[int] = []
    for chunk in client.completions.create(model=d.name, prompt=prompt, max_tokens=8, stream=True):
        got += chunk.choices[0].model_extra["token_ids"]
    assert got == want, got
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as unknown:  # a model it does not serve, as vLLM answers
        client.completions.create(model="no-such-model", prompt=prompt, max_tokens=8)
    assert unknown.value.code == "model_not_found" and "`no-such-model` does not exist" in str(unknown.value)

    # `eepctl generate` through the same endpoint: the key as every command takes it, the line
    # streamed; no key is exit 3 and bad input the ingress refuses exit 2, one line each
    gen = eepctl("generate", "--name", d.name, "-p", "3,1,4,1,5", timeout=60, env={"EEPCTL_API_KEY": API_KEY})
    assert gen.returncode == 0 and gen.stdout.startswith(f"[3 1 4 1 5] -> {' '.join(map(str, want))}  ("), gen
    for args, code, says in (
        (["-p", "1,2"], 3, "refused the API key (HTTP 401)"),
        (["--prompt-ids=-1,2", "--api-key", API_KEY], 2, "refused the request (HTTP 400)"),
        (["-p", "1,2", "--max-tokens", "200", "--api-key", API_KEY], 2, "maximum context length is 128 tokens"),
    ):
        t0 = time.time()
        res = eepctl("generate", "--name", d.name, *args, timeout=60)
        assert res.returncode == code and res.stdout == "" and says in res.stderr, res
        assert len(res.stderr.strip().splitlines()) == 1 and API_KEY not in res.stderr, res.stderr
        assert "re-sent" not in res.stderr and time.time() - t0 < 30, (time.time() - t0, res.stderr)
    # no registry snapshot to read it from (the registry gone): the ingress actors say their URLs
    from engine_ext.drivers.reference import ReferenceDriver

    assert ReferenceDriver(d.name, None, None).endpoints() == [url]
    # the endpoint comes from the registry's light read path: generate is no Ray driver at all
    code = (
        "import sys; from eepctl.main import run; rc = run(['generate', '--name', %r, '-p', '1,2', '-o', 'json']);"
        " assert 'ray' not in sys.modules, 'ray imported'; sys.exit(rc)" % d.name
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, EEPCTL_API_KEY=API_KEY),
    )
    assert res.returncode == 0 and json.loads(res.stdout)["results"][0]["output"] == oracle(cfg_d, [1, 2], 8), res
    _a_restarted_ingress_waits_for_its_pinned_port(d.name, port)


def _a_restarted_ingress_waits_for_its_pinned_port(name: str, port: int) -> None:
    """Ingress 0 (pinned to ``port``) SIGKILLed and the port taken by this test before Ray restarts
    it: the restarted ingress does not move elsewhere; it says why it does not listen (its stats,
    `eepctl status`) and listens on its port again once the port is free."""
    import ray
    from engine_ext.ray.names import ingress_name
    from tests.helpers import eepctl

    def stats() -> dict[str, Any] | None:
        try:
            return _ingress_stats(name)
        except Exception:  # noqa: BLE001 - being restarted
            return None

    def take() -> socket.socket | None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the port's TIME_WAIT connections
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            return s
        except OSError:  # the killed process's socket not closed yet
            s.close()
            return None

    os.kill(
        ray.get(ray.get_actor(ingress_name(name, 0), namespace=NAMESPACE).pid.remote(), timeout=30), signal.SIGKILL
    )  # this test's own deployment's ingress actor
    held = wait_for(take, timeout=30, interval=0.05, what=f"port {port} free after the kill")
    try:
        st = wait_for(
            lambda: (s := stats()) and s["restarted"] and s["listen_error"] and s,
            timeout=90,
            what="the restarted ingress saying why it does not listen",
        )
        assert st["listen_error"] == f"cannot listen on 127.0.0.1:{port}: Address already in use" and not st["url"]
        line = f"ingress 0: not listening: cannot listen on 127.0.0.1:{port}: Address already in use"
        wait_for(lambda: line in eepctl("status", "--name", name, timeout=60).stdout, timeout=30, what=line)
    finally:
        held.close()
    st = wait_for(lambda: (s := stats()) and s["url"] and s, timeout=30, what="ingress 0 listening again")
    assert st["url"] == f"http://127.0.0.1:{port}" and st["listen_error"] == "", st


def _input_the_model_cannot_serve_is_refused_at_once(name: str, url: str, auth: tuple[str, str], address: str) -> None:
    """Beyond the model's limits (SMALL_ENGINE: vocabulary 256, max_model_len 128): the ingress
    answers 400 from the limits the controller told it, in OpenAI's error shape; a request that
    reaches a rank anyway (an actor call: no HTTP check) is refused there and answered at once,
    never parked for a world."""
    import ray
    from eepctl import cluster
    from engine_ext.ray.names import ingress_name

    refused = (
        ({"prompt": [1, 2], "max_tokens": 200}, "max_tokens", "maximum context length is 128"),
        ({"prompt": [1, 300], "max_tokens": 4}, "prompt", "token id 300 is not in the vocabulary"),
    )
    for req, param, says in refused:
        for stream in (False, True):
            t0 = time.time()
            body, code = _body_and_code(
                _curl(
                    *auth,
                    "-H",
                    "Content-Type: application/json",
                    "-d",
                    json.dumps(dict(req, stream=stream)),
                    f"{url}/v1/completions",
                )
            )
            err = json.loads(body)["error"]
            assert code == 400 and time.time() - t0 < 10 and says in err["message"], body
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, 400), err
    cluster.connect(address, NAMESPACE)
    ingress = ray.get_actor(ingress_name(name, 0), namespace=NAMESPACE)
    res = ray.get(ingress.generate.remote([1, 2], 200), timeout=30)
    assert res["rejected"] and "exceeds max_model_len 128" in res["error"] and "engine_ext." not in res["error"], res
    assert _ingress_stats(name)["parked"] == 0


def _handed_back_to_a_restarting_ingress_is_not_lost(name: str, live_request_id: str) -> None:
    """What the controller does with requests a removing rank hands back (IngressLink.resubmit),
    right after ingress 0 was killed: the call to it fails while Ray restarts it, and is made again
    until the restarted ingress answers (which drops its predecessor's request: its client left
    with it); ingress 1 takes its own."""
    import asyncio

    from engine_ext.ray.ingress_link import IngressLink

    link = IngressLink(name, NAMESPACE, 2, fenced=dict)
    gone = {"request_id": "i0/killed-0123456789ab", "prompt": [1, 2, 3], "max_tokens": 4}
    ours = {"request_id": live_request_id, "prompt": [1, 2, 3], "max_tokens": 4}

    async def both() -> list[bool]:
        return list(await asyncio.gather(link.hand_back(0, [gone]), link.hand_back(1, [ours])))

    assert asyncio.run(both()) == [True, True] and link.handed_back_lost == 0


@pytest.mark.timeout(300)
def test_an_ingress_killed_under_load_is_restarted_and_its_requests_are_resent(deployments, ray_cluster):
    """Two ingresses, 4 requests/s sent to their HTTP endpoints in turn; ingress 0 SIGKILLed: Ray
    restarts it (HTTP again on the same URL), the requests whose streams it dropped are sent again
    by `eepctl generate` from their prompts to the other ingress (their records say `resent`, a
    note on stderr says so), none fails, every output equals the oracle."""
    import ray
    from eepctl import cluster
    from engine_ext.ray.names import ingress_name

    cluster.connect(ray_cluster["address"], NAMESPACE)
    d = deployments("ing-kill")
    snap = _up(d.name, 1, ingress=2, faults=["hold:step@0"], delay_s=2.0)
    cfg_d = snap["info"]["config"]
    url = snap["info"]["ingress"][0]["url"]
    load = d.popen("generate", "--name", d.name, "--rate", "4", "--duration", "8", "--max-tokens", "16", "-o", "json")
    wait_held(d.name, 0, "step", timeout=120)  # requests mid-decode, half of them ingress 0's
    handle = ray.get_actor(ingress_name(d.name, 0), namespace=NAMESPACE)
    old = ray.get(handle.pid.remote(), timeout=30)
    live = ray.get(ray.get_actor(ingress_name(d.name, 1), namespace=NAMESPACE).new_request_id.remote(), timeout=30)
    os.kill(old, signal.SIGKILL)  # this test's own deployment's ingress actor
    _handed_back_to_a_restarting_ingress_is_not_lost(d.name, live)
    res = finish_load(load, cfg_d, 16)  # all 32 sent (across the restart): none failed, all equal to the oracle
    resent = [r for r in res["records"] if r["resent"]]
    assert resent, "no request was held by the killed ingress"
    notes = [ln for ln in res["stderr"].splitlines() if "re-sent from its prompt" in ln]
    assert len(notes) >= len(resent) and all(url in n and "Traceback" not in n for n in notes), res["stderr"][-2000:]
    st = wait_for(lambda: (s := _ingress_stats(d.name, 0))["restarted"] and s, timeout=60, what="ingress 0 back")
    assert ray.get(handle.pid.remote(), timeout=30) != old and st["url"] == url, st
    assert st["handed_back"] == {"resubmitted": 0, "dropped": 1}, st  # told, not lost: its predecessor's request
    assert _ingress_stats(d.name, 1)["handed_back"] == {"resubmitted": 1, "dropped": 0}
    body, code = _body_and_code(
        _curl(
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}),
            f"{url}/v1/completions",
        )
    )
    assert code == 200 and json.loads(body)["choices"][0]["token_ids"] == oracle(cfg_d, [1, 2, 3], 4), body
    print(
        f"\n[ingress] killed with requests: {len(resent)} re-sent, {res['completed']} of {len(res['records'])} served"
    )
