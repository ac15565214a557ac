"""Who can send requests is visible, and only the deployment's own key guards it: `up`'s and
`status`'s lines when the HTTP API has no key, `--host`/`--port` checked before any connection,
VLLM_API_KEY never made a reference deployment's key (`up` says it left it unused), and the key
`generate` sends chosen by the deployment's kind. No Ray here: what a real `up` shows is checked in
tests/test_cli_ray.py::test_lifecycle_up_generate_status_events_down (no key, VLLM_API_KEY set)
and tests/test_ingress_ray.py::test_http_api_with_curl_and_the_openai_client (a key, --host/--port).
"""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from eepctl import render
from eepctl.cli import app
from engine_ext.drivers import request_key
from engine_ext.protocol import EepError, ExitCode, UsageError

pytestmark = pytest.mark.timeout(60)

NO_KEY = "no key: anyone who reaches the port can send requests"


def _ingress(**over: object) -> dict[str, object]:
    ing = {
        "index": 0,
        "url": "http://10.0.0.5:8000",
        "listen": "0.0.0.0:8000",
        "key_required": False,
        "note": "",
        "listen_error": "",
        "parked": 0,
        "inflight": 0,
        "restarted": False,
    }
    ing.update(over)
    return ing


def _up_result(*ingresses: dict[str, object]) -> dict[str, object]:
    return {
        "deployment": "d",
        "namespace": "eepctl",
        "address": "127.0.0.1:6379",
        "dp": 1,
        "max_dp": 2,
        "cluster_started": False,
        "elapsed_s": 1.0,
        "ranks": [],
        "ingress": list(ingresses),
    }


def test_up_says_where_the_api_listens_and_that_it_has_no_key() -> None:
    text = render.up_text(_up_result(_ingress()))
    assert f"API: http://10.0.0.5:8000 (ingress 0, listening on 0.0.0.0:8000), {NO_KEY}" in text, text
    keyed = render.up_text(_up_result(_ingress(key_required=True)))
    assert "no key" not in keyed and "a key is required (Authorization: Bearer KEY)" in keyed, keyed
    local = render.up_text(_up_result(_ingress(listen="127.0.0.1:8000", url="http://127.0.0.1:8000")))
    assert "no key: anyone on its node can send requests" in local, local


def test_status_says_which_ingress_has_no_key_why_it_moved_or_does_not_listen() -> None:
    from eepctl.render_control import ingress_lines

    snap = {
        "info": {
            "ingress": [
                _ingress(),
                _ingress(
                    index=1,
                    url="http://10.0.0.5:40123",
                    key_required=True,
                    restarted=True,
                    note="port 8001 was taken when it restarted: now 40123 (the URL changed)",
                ),
                _ingress(
                    index=2,
                    url="",
                    key_required=True,
                    restarted=True,
                    listen_error="cannot listen on 0.0.0.0:8002: Address already in use",
                ),
                {"index": 3, "url": "http://10.0.0.5:8003"},  # an ingress that does not say: nothing claimed
            ]
        }
    }
    assert ingress_lines(snap) == [
        f"ingress 0: http://10.0.0.5:8000, {NO_KEY}",
        "ingress 1: http://10.0.0.5:40123 (restarted by Ray) (port 8001 was taken when it restarted: now 40123 "
        "(the URL changed))",
        "ingress 2: not listening: cannot listen on 0.0.0.0:8002: Address already in use (trying again every "
        "second) (restarted by Ray)",
        "ingress 3: http://10.0.0.5:8003",
    ]


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for var in ("RAY_ADDRESS", "VLLM_API_KEY", "EEPCTL_API_KEY", "EEPCTL_NAME", "EEPCTL_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)
    return CliRunner()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--host", "localhost"], "--host must be an IPv4 address"),
        (["--host", "::"], "--host must be an IPv4 address"),
        (["--port", "70000"], "--port must be 0 (any free port) or 1-65535"),
        (["--port", "-1"], "--port must be 0"),
        (["--port", "65535", "--ingress", "2"], "1-65534 (ingress i listens on PORT+i), got 65535"),
    ],
)
def test_host_and_port_are_checked_before_any_connection(runner: CliRunner, args: list[str], says: str) -> None:
    result = runner.invoke(app, ["up", "--address", "127.0.0.1:1", *args])
    assert isinstance(result.exception, UsageError) and says in result.exception.message, result.exception


@pytest.fixture
def closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_up_leaves_vllm_api_key_unused_and_says_so(runner: CliRunner, closed_address: str) -> None:
    """Before the cluster is asked (nothing listens at the address: exit 3 after the note)."""
    result = runner.invoke(app, ["up", "--address", closed_address], env={"VLLM_API_KEY": "vllm-secret"})
    assert isinstance(result.exception, EepError) and result.exception.exit_code == ExitCode.UNREACHABLE
    assert (
        "note: VLLM_API_KEY is set and not used: a reference deployment's API key comes from --api-key or "
        "EEPCTL_API_KEY" in result.stderr
    ), result.stderr
    assert "vllm-secret" not in result.output
    for env in ({"VLLM_API_KEY": "vllm-secret", "EEPCTL_API_KEY": "eep-secret"}, {}):
        quiet = runner.invoke(app, ["up", "--address", closed_address], env=env)
        assert "note:" not in quiet.stderr, quiet.stderr


def test_up_help_names_its_own_variable(runner: CliRunner) -> None:
    result = runner.invoke(app, ["up", "--help"], env={"EEPCTL_API_KEY": "secret-never-shown", "COLUMNS": "200"})
    assert result.exit_code == 0 and "EEPCTL_API_KEY" in result.output and "--host" in result.output
    assert "secret-never-shown" not in result.output


def test_generate_sends_the_key_its_deployment_kind_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    monkeypatch.setenv("EEPCTL_API_KEY", "eep-key")
    reference, vllm = {"kind": "reference", "info": {}}, {"kind": "vllm", "info": {}}
    assert (request_key(reference, None), request_key(None, None), request_key(vllm, None)) == (
        "eep-key",
        "eep-key",
        "vllm-key",
    )
    assert request_key(reference, "given") == request_key(vllm, "given") == "given"
    monkeypatch.delenv("EEPCTL_API_KEY")
    assert request_key(reference, None) is None  # a vLLM key is never sent to an ingress
