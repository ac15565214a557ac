"""The CLI's pure paths in-process through typer's CliRunner: help, usage errors, the checks a
command makes before it talks to a cluster, the completion scripts, and the load generator.

Nothing here needs Ray: every case fails or finishes before a command connects. A command
raises the project's typed error (eepctl.main maps it to the exit code and one stderr line; the
end-to-end exit codes are tested with real processes in test_cli_ray.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from typer.testing import CliRunner

from eepctl import loadgen, render
from eepctl.cli import app
from engine_ext.protocol import EepError, ExitCode, UsageError
from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """A runner with no cluster address and no API key in its environment."""
    for var in ("RAY_ADDRESS", "VLLM_API_KEY", "EEPCTL_NAME", "EEPCTL_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)
    return CliRunner()


def _typed_error(runner: CliRunner, *args: str) -> EepError:
    result = runner.invoke(app, list(args))
    assert isinstance(result.exception, EepError), (result.exit_code, result.output, result.exception)
    return result.exception


# ---- help ------------------------------------------------------------------------------------------
def test_help_lists_every_command(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("up", "down", "status", "generate", "scale", "events", "completion"):
        assert command in result.output


@pytest.mark.parametrize("command", ["generate", "scale"])
def test_api_key_option_names_its_variable_and_no_value(runner: CliRunner, command: str) -> None:
    result = runner.invoke(app, [command, "--help"], env={"VLLM_API_KEY": "secret-never-shown"})
    assert result.exit_code == 0
    assert "--api-key" in result.output and "VLLM_API_KEY" in result.output
    assert "secret-never-shown" not in result.output


def test_version_comes_from_the_package_metadata_without_heavy_imports(runner: CliRunner) -> None:
    import subprocess
    import sys
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"eepctl {version('eepctl')}\n", result.output
    code = (
        "import sys; from eepctl.main import run; assert run(['--version']) == 0; "
        "print(sorted(m for m in ('ray', 'torch', 'vllm', 'numpy') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0 and res.stdout == f"eepctl {version('eepctl')}\n[]\n", (res.stdout, res.stderr)


# ---- usage errors the command framework finds ------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["scale", "--dp", "x"],
        ["scale"],  # --dp is required
        ["status", "-o", "yaml"],
        ["frobnicate"],
        ["generate", "--rate", "fast"],
    ],
)
def test_malformed_arguments_exit_2(runner: CliRunner, args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == ExitCode.USAGE, (result.exit_code, result.output)


@pytest.mark.parametrize(
    "command, options",
    [
        ("status", ("--state", "--node", "--watch")),
        ("scale", ("--verbose",)),
        ("events", ("--timeline", "--last", "--verbose")),
    ],
)
def test_operator_view_options_are_documented(runner: CliRunner, command: str, options: tuple[str, ...]) -> None:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for opt in options:
        assert opt in result.output, (opt, result.output)


# ---- checks a command makes before it connects -----------------------------------------------------
@pytest.mark.parametrize(
    "args, says",
    [
        (["scale", "--dp", "0"], "--dp"),
        (["scale", "--dp", "2", "--timeout", "0"], "--timeout"),
        (["up", "--dp", "0"], "--dp"),
        (["up", "--dp", "3", "--max-dp", "2"], "--max-dp"),
        (["up", "--dtype", "int8"], "--dtype"),
        (["up", "--top-k", "9"], "invalid engine option"),
        (["up", "--capture-policy", "never"], "--capture-policy"),
        (["up", "--standby", "-1"], "--standby"),
        (["standby", "--count", "-1"], "--count"),
        (["generate", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "-p", "1,two,3"], "comma-separated integers"),
        (["generate", "--rate", "0"], "--rate"),
        (["completion", "tcsh"], "bash, zsh or fish"),
        (["events", "--last", "-1"], "--last must be >= 0"),
    ],
)
def test_bad_values_are_usage_errors(runner: CliRunner, args: list[str], says: str) -> None:
    err = _typed_error(runner, *args)
    assert isinstance(err, UsageError) and err.exit_code == ExitCode.USAGE
    assert says in err.message, err.message


@pytest.mark.parametrize("option", ["--namespace", "--name"])
@pytest.mark.parametrize("bad", ["../x", "a b", "x/y", "UPPER", ""])
def test_names_and_namespaces_are_validated(runner: CliRunner, option: str, bad: str) -> None:
    err = _typed_error(runner, "status", option, bad)
    assert isinstance(err, UsageError)
    what = "namespace" if option == "--namespace" else "deployment name"
    assert f"invalid {what}" in err.message, err.message


def test_no_cluster_is_unreachable(runner: CliRunner, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No address anywhere (and no cluster eepctl started): exit 3 before any Ray import cost."""
    monkeypatch.setenv("EEPCTL_STATE_DIR", str(tmp_path))
    err = _typed_error(runner, "status", "--name", "x")
    assert err.exit_code == ExitCode.UNREACHABLE and "no Ray cluster" in err.message


# ---- completion scripts ----------------------------------------------------------------------------
@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_the_committed_script(runner: CliRunner, shell: str) -> None:
    result = runner.invoke(app, ["completion", shell])
    assert result.exit_code == 0
    assert result.stdout == (ROOT / "completions" / f"eepctl.{shell}").read_text()
    assert "_EEPCTL_COMPLETE" in result.stdout


# ---- the load generator ----------------------------------------------------------------------------
class _Answered:
    """A request answered at once by this process (the engine's part of the contract)."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer

    def wait(self, timeout_s: float) -> dict[str, Any]:
        return self.answer


class _Late:
    """A request whose answer never comes within the wait: the engine's timeout path."""

    def wait(self, timeout_s: float) -> dict[str, Any]:
        raise EepError(f"no answer within {timeout_s:.0f}s")


def test_open_loop_sends_at_the_rate_and_reports_every_outcome() -> None:
    sent_at: list[float] = []
    lock = threading.Lock()

    def submit(prompt: list[int]) -> Any:
        with lock:
            sent_at.append(time.monotonic())
        if prompt == [3]:
            return _Late()
        if prompt == [2]:
            return _Answered({"output": [], "error": "engine failed", "latency_s": 0.01})
        return _Answered({"output": [prompt[0] * 10], "error": None, "latency_s": 0.02 * prompt[0], "moved_from": [1]})

    prompts = [[1], [2], [3], [4]]
    res = loadgen.open_loop(submit, prompts, rate=40.0, duration_s=0.5, timeout_s=5.0, seed=3)
    assert res["sent"] == len(res["records"]) == len(sent_at) == 20
    span = sent_at[-1] - sent_at[0]
    assert 19 / 40 - 0.01 <= span < 19 / 40 + 0.5, span  # open loop: paced, not faster than the rate
    for rec in res["records"]:
        prompt = prompts[rec["prompt_index"]]
        if prompt == [3]:
            assert rec["error"].startswith("no answer within") and rec["latency_s"] is None
        elif prompt == [2]:
            assert rec["error"] == "engine failed"
        else:
            assert rec["error"] is None and rec["output"] == [prompt[0] * 10] and rec["moved_from"] == [1]
    ok = [r for r in res["records"] if r["error"] is None]
    assert res["completed"] == len(ok) and res["failed"] == 20 - len(ok)
    assert res["latency_s"]["max"] == max(r["latency_s"] for r in ok)


def test_each_request_waits_its_timeout_from_its_own_sending() -> None:
    """A long load must not eat the last requests' wait: the budget counts from each one's sending
    (before, it counted from the load's start, so a 900 s load needed --timeout 1500)."""
    waits: list[float] = []

    class _Recorded:
        def wait(self, timeout_s: float) -> dict[str, Any]:
            waits.append(timeout_s)
            return {"output": [1], "error": None, "latency_s": 0.01}

    res = loadgen.open_loop(lambda prompt: _Recorded(), [[1]], rate=4.0, duration_s=1.0, timeout_s=2.0)
    assert res["sent"] == 4 and res["failed"] == 0
    # awaited in order once the last was sent (0.75 s in): the first has 0.75 s of its budget used,
    # the last none of it (counted from the load's start, every wait would be about 1.25 s)
    assert 1.15 <= waits[0] <= 1.35 and 1.9 <= waits[-1] <= 2.0, waits


def test_sigint_ends_the_sending_and_the_requests_sent_are_still_reported() -> None:
    """A real SIGINT to this process (the main thread, as in `eepctl generate --rate`): sending
    ends early, every request already sent is awaited and reported; a second SIGINT interrupts."""
    import os
    import signal

    sent: list[int] = []

    def submit(prompt: list[int]) -> Any:
        sent.append(prompt[0])
        if len(sent) == 3:
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        return _Answered({"output": [prompt[0]], "error": None, "latency_s": 0.01})

    before = signal.getsignal(signal.SIGINT)
    with loadgen.interrupt_ends_sending() as stop:
        res = loadgen.open_loop(submit, [[1], [2]], rate=20.0, duration_s=10.0, timeout_s=5.0, stop=stop)
        assert res["stopped_early"] is True and 3 <= res["sent"] <= 5 and res["sent"] == len(sent), res["sent"]
        assert res["completed"] == res["sent"] and res["failed"] == 0
        with pytest.raises(KeyboardInterrupt):  # the second one
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before  # restored
    full = loadgen.open_loop(submit, [[1]], rate=50.0, duration_s=0.1, timeout_s=5.0)
    assert full["stopped_early"] is False and full["sent"] == 5


def test_percentiles_are_nearest_rank() -> None:
    values = [i / 100 for i in range(1, 101)]  # 0.01 .. 1.00
    p = loadgen.percentiles(values[::-1])
    assert p == {"p50": 0.51, "p90": 0.9, "p99": 0.99, "max": 1.0, "mean": 0.505}
    assert loadgen.percentiles([]) == {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}


# ---- renderers -------------------------------------------------------------------------------------
def test_generate_and_load_text() -> None:
    reference = {"prompt": [1, 2], "output": [7, 8], "error": None, "latency_s": 0.0123, "rank": 1, "moved_from": []}
    vllm = dict(reference, rank=None)  # a vLLM server does not say which rank served
    failed = dict(reference, output=[], error="rank 1 failed")
    text = render.generate_text({"deployment": "d", "results": [reference, vllm, failed]})
    assert text.splitlines() == [
        "[1 2] -> 7 8  (12 ms, rank 1)",
        "[1 2] -> 7 8  (12 ms)",
        "[1 2] -> ERROR rank 1 failed  (12 ms, rank 1)",
    ]
    load = {
        "sent": 8,
        "rate": 4.0,
        "duration_s": 2.04,
        "completed": 7,
        "failed": 1,
        "latency_s": loadgen.percentiles([0.1, 0.2, 0.3]),
    }
    assert render.load_text(load).splitlines() == [
        "sent 8 at 4/s over 2.0s: completed 7, failed 1",
        "latency p50 200 ms, p90 300 ms, p99 300 ms, max 300 ms",
    ]
    assert render.load_text(dict(load, stopped_early=True)).splitlines()[0] == (
        "sent 8 at 4/s over 2.0s (sending ended early by SIGINT): completed 7, failed 1"
    )


def test_up_waits_until_every_rank_serves_or_exits_with_the_documented_code():
    """`up` returns once every DP rank's heartbeat says serving (standbys aside); a failed rank
    ends it with exit 5 and the deadline (--timeout) with exit 6, naming each rank's state."""
    import time

    from eepctl.core import wait_serving
    from engine_ext.errors import EepError

    def ranks(*states: str, standby: bool = False) -> dict:
        out = [{"rank": r, "state": s} for r, s in enumerate(states)]
        return {"ranks": out + ([{"rank": 100000, "state": "standby"}] if standby else [])}

    seq = iter([ranks("starting", "serving"), ranks("serving"), ranks("serving", "serving", standby=True)])
    assert wait_serving(lambda: next(seq), "d", 2, time.time() + 30, interval_s=0) == ranks(
        "serving", "serving", standby=True
    )
    with pytest.raises(EepError, match="rank 1 failed") as failed:
        wait_serving(lambda: ranks("serving", "failed"), "d", 2, time.time() + 30, interval_s=0)
    assert int(failed.value.exit_code) == 5
    with pytest.raises(
        EepError, match="did not serve at DP 2 before --timeout: rank 0 serving, rank 1 starting"
    ) as late:
        wait_serving(lambda: ranks("serving", "starting"), "d", 2, time.time() + 0.2, interval_s=0.01)
    assert int(late.value.exit_code) == 6


def test_up_refuses_a_world_whose_workspace_eats_the_kv_budget(runner: CliRunner) -> None:
    """Under reuse the workspace is sized for --max-dp from the start: at 16 ranks x 64 tokens it
    takes more than the default 128 KV blocks, so every request would wait forever. Exit 4 before
    a cluster is touched (the address names no cluster: without the check it would not be exit 4)."""
    from engine_ext.protocol import PreconditionError

    err = _typed_error(
        runner, "up", "--dp", "2", "--max-dp", "16", "--capture-policy", "reuse", "--address", "127.0.0.1:1"
    )
    assert isinstance(err, PreconditionError) and err.exit_code == ExitCode.PRECONDITION, err.message
    assert "cannot start DP 2: at DP 2 the MoE workspace takes" in err.message and "KV budget" in err.message


# ---- output that a signal interrupts ----------------------------------------------------------------
_WRITER = """
import json, sys
from eepctl.loadgen import interrupt_ends_sending
from eepctl.options import emit
text = json.dumps({"report": list(range(60000))}) + "\\n"  # about 400 KB: past a pipe's 64 KiB
sys.stderr.write("ready\\n"); sys.stderr.flush()
with interrupt_ends_sending():  # what generate --rate holds while its report is printed
    if sys.argv[1] == "emit":
        emit(text)
    else:  # the way emit wrote before: the text stream's write and flush
        sys.stdout.write(text); sys.stdout.flush()
"""


@pytest.mark.parametrize("how", ["emit", pytest.param("text-stream", id="text-stream-write")])
def test_a_report_interrupted_while_the_reader_lags_comes_out_whole(how: str) -> None:
    """A Ctrl-C (a script's SIGINT) that lands while the command's output is blocked on a full
    pipe (its reader busy elsewhere: the test helper reading stderr first, a slow `jq`) ends
    nothing, and every byte of the report still comes out. Written through the text stream (the
    harm, `test_autoscale_e2e_ray` in a CI run) the output stopped at a multiple of 64 KiB with
    exit 0 and no error; ``options.emit`` writes the bytes itself until all are out."""
    import json
    import signal
    import subprocess
    import sys

    cut = []
    for _ in range(3):
        p = subprocess.Popen(
            [sys.executable, "-c", _WRITER, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
        )
        assert p.stderr is not None and p.stderr.readline() == b"ready\n"
        time.sleep(0.5)  # the writer fills the pipe and blocks in its write
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err[-500:]
        try:
            assert json.loads(out)["report"][-1] == 59999
        except ValueError:
            cut.append(len(out))
    if how == "emit":
        assert cut == [], f"reports cut at {cut} bytes"
    else:
        # the harm: reports cut short (at the pipe's capacity, 64 KiB, or a little past it on a loaded
        # box where the reader began before the writer was interrupted)
        assert len(cut) == 3, cut
