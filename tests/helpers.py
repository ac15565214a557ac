"""Helpers the test modules share: run the real CLI, wait on a condition, and the checks of a
live deployment (status views, the oracle, load results). Fixtures live in conftest.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "eepctl"
MAX_TOKENS = 8  # `eepctl generate`'s default
SENDING_NOTE = (
    "requests/s for"  # in the note `eepctl generate --rate` gives as it begins sending (eepctl.loadgen.SENDING)
)
# Seconds a Ray head a test started gets between SIGTERM and SIGKILL: its deployments are down by
# then, and a head whose raylet had detached actors outlived the CLI's 15 s default grace.
STOP_GRACE_S = 3.0
SMALL_ENGINE = {
    "num_experts": 8,
    "slots_per_rank": 8,
    "top_k": 2,
    "num_layers": 2,
    "hidden_size": 64,
    "max_num_seqs": 8,
    "max_num_tokens": 64,
    "dtype": "float64",
    "seed": 0,
    "capture_sizes": [1, 2, 4, 8],
    "capture_policy": "recapture",
}


def eepctl(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as an operator or a script would."""
    full_env = dict(os.environ, NO_COLOR="1", COLUMNS="200", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "eepctl", *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT
    )


def last_json(text: str) -> dict[str, Any]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every non-empty line of an ``-o json`` stdout, each parsed: a line that is not JSON (a
    library's stray print) fails the test."""
    objs = []
    for ln in text.splitlines():
        if ln.strip():
            try:
                objs.append(json.loads(ln))
            except ValueError:
                raise AssertionError(f"stdout of -o json holds a line that is not JSON: {ln[:300]!r}") from None
    assert objs, "no output"
    return objs


def eepctl_json(*args: str, timeout: float = 300) -> dict[str, Any]:
    res = eepctl(*args, "-o", "json", timeout=timeout)
    assert res.returncode == 0, f"eepctl {' '.join(args)} exited {res.returncode}: {res.stderr}"
    return last_json(res.stdout)


def wait_for(pred: Callable[[], Any], timeout: float = 20.0, interval: float = 0.25, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Deployment:
    """A deployment a test owns: torn down by name, and its background CLI processes ended."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.procs: list[subprocess.Popen] = []

    def popen(self, *args: str, stdout: Any = subprocess.PIPE) -> subprocess.Popen:
        """The CLI in the background; ``stdout`` a file for a long ``--watch`` (a pipe nobody
        reads fills, and its writer blocks)."""
        env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
        p = subprocess.Popen(
            [sys.executable, "-m", "eepctl", *args], stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        self.procs.append(p)
        return p


@contextlib.contextmanager
def owned_deployments() -> Iterator[Callable[[str], Deployment]]:
    """Makes ``Deployment``s by name; on exit ends their background CLI processes (by their Popen
    handle, nothing else) and brings each down by name."""
    owned: list[Deployment] = []

    def make(name: str) -> Deployment:
        d = Deployment(name)
        owned.append(d)
        return d

    try:
        yield make
    finally:
        for d in owned:
            for p in d.procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate(timeout=30)
            eepctl("down", "--name", d.name, timeout=120)


def up_cli(d: Deployment, dp: int, max_dp: int, *extra: str) -> dict[str, Any]:
    # recapture, as SMALL_ENGINE: the tests see every rank re-warm and capture in each scale (I4, I5)
    res = eepctl(
        "up",
        "--dp",
        str(dp),
        "--max-dp",
        str(max_dp),
        "--dtype",
        "float64",
        "--name",
        d.name,
        "--capture-policy",
        "recapture",
        *extra,
        "-o",
        "json",
        timeout=300,
    )
    assert res.returncode == 0, f"up {d.name} exited {res.returncode}: {res.stderr}"
    return last_json(res.stdout)


def status(name: str) -> dict[str, Any]:
    return eepctl_json("status", "--name", name, timeout=60)


def events(name: str, op: str | None = None) -> dict[str, Any]:
    return eepctl_json("events", "--name", name, *(("--op", op) if op else ()), timeout=60)


def scale_json(name: str, dp: int, *extra: str) -> dict[str, Any]:
    op = eepctl_json("scale", "--dp", str(dp), "--name", name, *extra, timeout=300)
    assert op.get("object") == "scale", op
    return op


def serving_view(name: str, n: int | list[int], timeout: float = 15.0) -> dict[str, Any]:
    """Status once exactly the ranks ``n`` (a list, or 0..n-1) are listed and all serve (heartbeats
    are eventually consistent)."""
    want = sorted(n) if isinstance(n, list) else list(range(n))

    def ok() -> dict[str, Any] | None:
        s = status(name)
        ranks = s["ranks"]
        if sorted(r["rank"] for r in ranks) == want and all(r["state"] == "serving" for r in ranks):
            return s
        return None

    return wait_for(ok, timeout=timeout, interval=0.5, what=f"{name}: ranks {want} serving")


def members_after(members: list[int], op: dict[str, Any]) -> list[int]:
    """The members once the scale ``op`` succeeded: its plan's leavers out, its joiners in (a
    scale-down without --retire removes the least-loaded ranks, not always the last)."""
    plan = op["plan"]
    gone = {j["rank"] for j in plan.get("leaving", [])}
    return sorted((set(members) - gone) | {j["rank"] for j in plan.get("joining", [])})


def steps_total(name: str) -> int:
    """Engine steps of all ranks: an idle rank does not step, so a rise means requests are served."""
    return sum(int(r.get("steps", 0)) for r in status(name)["ranks"])


def wait_serving_load(name: str, timeout: float = 30.0) -> None:
    """Wait until the deployment has run engine steps for a load started in the background."""
    base = steps_total(name)
    wait_for(lambda: steps_total(name) > base, timeout=timeout, interval=0.3, what=f"{name}: the load being served")


_ORACLE: dict[tuple, list[int]] = {}


def oracle(cfg_d: dict[str, Any], prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens of the single-process reference run, once per distinct (model, prompt)."""
    from engine_ext.config import EngineConfig
    from engine_ext.model.dense_oracle import reference_generate

    cfg = EngineConfig.from_dict(cfg_d)
    model_key = {
        k: v
        for k, v in cfg.to_dict().items()
        if k not in ("instance_id", "kv_transfer", "faults", "fault_delay_s", "slots_per_rank")
    }
    key = (json.dumps(model_key, sort_keys=True), tuple(prompt), max_tokens)
    if key not in _ORACLE:
        _ORACLE[key] = list(reference_generate(cfg, [list(prompt)], max_tokens)[0]["output"])
    return _ORACLE[key]


def check_load(load: dict[str, Any], cfg_d: dict[str, Any], max_tokens: int = MAX_TOKENS) -> None:
    """No request failed and every output equals the oracle's."""
    assert load["failed"] == 0, [r["error"] for r in load["records"] if r["error"]][:5]
    assert load["sent"] == load["completed"] == len(load["records"]), load
    for i, rec in enumerate(load["records"]):
        want = oracle(cfg_d, load["prompts"][rec["prompt_index"]], max_tokens)
        assert rec["output"] == want, f"record {i} prompt {rec['prompt_index']}: {rec['output']} != oracle {want}"


def stop_sending(proc: Any, timeout: float = 120.0) -> None:
    """End an `eepctl generate --rate` process's sending now (SIGINT, by its Popen handle): the
    scenario it loaded is over; the requests it sent are still awaited and reported. The signal
    goes once the process said it is sending (its stderr note): before that, a SIGINT interrupts
    the command (exit 130), as it would an operator's, which on a slow box starting the process
    (imports, connecting) raced the test's own steps."""
    import selectors

    marker = SENDING_NOTE.encode()
    head: bytes = getattr(proc, "stderr_head", b"")
    fd = proc.stderr.fileno()
    deadline = time.time() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while marker not in head and proc.poll() is None and time.time() < deadline:
            if sel.select(timeout=0.2):
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                head += chunk
    proc.stderr_head = head  # communicate() reads the rest; finish_load joins them
    assert marker in head or proc.poll() is not None, f"the load never said it was sending: {head[-2000:]!r}"
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)


def finish_load(
    proc: Any, cfg_d: dict[str, Any], max_tokens: int = MAX_TOKENS, *, stop: bool = False
) -> dict[str, Any]:
    """Wait for an `eepctl generate --rate` process (``stop``: ending its sending first); it exited
    0, lost nothing, matched the oracle. Its stderr comes back as ``res["stderr"]``."""
    if stop:
        stop_sending(proc)
    out, err = proc.communicate(timeout=120)
    err = getattr(proc, "stderr_head", b"").decode(errors="replace") + (err or "")
    assert proc.returncode == 0, f"load exited {proc.returncode}: {err[-2000:]}"
    res = json_lines(out)[-1]
    check_load(res, cfg_d, max_tokens)
    return dict(res, stderr=err)


def moved_off(records: list[dict[str, Any]], victim: int, *, resumed: bool = True) -> list[dict[str, Any]]:
    """The records of requests that were on ``victim`` when it died and completed elsewhere,
    continuing with the tokens it had streamed (``resumed_with`` > 0); fails when there are none,
    so a kill that found nothing in flight, or a lost stream, cannot pass. ``resumed=False``: a
    victim killed where it holds requests that may not have decoded yet (held in a transition)."""
    moved = [r for r in records if victim in (r.get("moved_from") or [])]
    assert moved, f"no request was in flight on rank {victim} at the kill (none has moved_from naming it)"
    for r in moved:
        assert r.get("error") is None and r.get("rank") not in (None, victim), r
    if not resumed:
        return moved
    continued = [r for r in moved if (r.get("resumed_with") or 0) > 0]
    assert continued, f"requests moved off rank {victim} restarted from their prompts (resumed_with 0): {moved[:3]}"
    return continued


def up_with_faults(
    name: str,
    dp: int,
    max_dp: int,
    faults: list[str],
    delay_s: float,
    *,
    on_rank_failure: str = "replace",
    standby: int = 0,
    placement: str = "pack",
    ingress: int = 1,
    **engine: Any,
) -> dict[str, Any]:
    """``up`` (in this process, as the CLI does) with the CLI's engine and test faults. This
    process's Ray connection is dropped first: it may belong to another test's cluster (the
    multi-node one points RAY_ADDRESS elsewhere), and a connected driver never re-reads it."""
    import ray
    from eepctl import core

    if ray.is_initialized():
        ray.shutdown()

    eng = dict(SMALL_ENGINE, faults=faults, fault_delay_s=delay_s, **engine)
    return core.up(
        core.Target(name=name, namespace=NAMESPACE),
        dp=dp,
        max_dp=max_dp,
        engine=eng,
        cpus_per_rank=1.0,
        gpus_per_rank=0.0,
        timeout_s=300,
        on_rank_failure=on_rank_failure,
        standby=standby,
        placement={"policy": placement, "ifname": ""},
        ingress=ingress,
    )


def _status_as_driver(name: str) -> dict[str, Any] | None:
    """The registry's status view read by this test process where it is a Ray driver already (None
    where it is not): one actor call, where `eepctl status` starts a process that takes seconds on a
    loaded box and so can miss a hold of a few seconds (CI: a 6 s launch hold never seen in 120 s)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    from eepctl.render import to_json
    from engine_ext.drivers import status_view
    from engine_ext.ray.deployment import actor, call
    from engine_ext.ray.names import registry_name

    registry = actor(registry_name(name), NAMESPACE)
    if registry is None:
        return None
    return json.loads(to_json("status", status_view(call(registry.snapshot.remote(), timeout=10))))  # as -o json


def wait_held(name: str, rank: int, phase: str, timeout: float = 90.0) -> dict[str, Any]:
    """Status once ``rank`` says a test fault holds it in ``phase`` (its pid is then listed)."""

    def ok() -> dict[str, Any] | None:
        s = _status_as_driver(name) or status(name)
        hit = any(
            r["rank"] == rank and f"held in {phase}" in (r.get("state_reason") or "") and r.get("pid")
            for r in s["ranks"]
        )
        return s if hit else None

    return wait_for(ok, timeout=timeout, interval=0.3, what=f"rank {rank} held in {phase}")


def serving_ranks(name: str, ranks: list[int], timeout: float = 90.0, gone: int | None = None) -> dict[str, Any]:
    """Status once exactly ``ranks`` serve at DP len(ranks) and no operation runs (with ``gone``,
    a killed rank's pid: and none of them is that process; right after a kill status can still
    show the world from before it); on timeout, what the last status showed."""
    seen: list[dict[str, Any]] = []

    def ok() -> dict[str, Any] | None:
        res = eepctl("status", "--name", name, "-o", "json", timeout=60)
        if res.returncode != 0:  # the controller or registry is being restarted: ask again
            return None
        s = json_lines(res.stdout)[-1]
        seen[:] = [s]
        live = [r for r in s["ranks"] if r["state"] not in ("stale", "removed", "fenced", "dead")]
        if gone is not None and any(int(r.get("pid") or 0) == gone for r in live):
            return None
        if (
            sorted(r["rank"] for r in live) == ranks
            and all(r["state"] == "serving" and r["dp_size"] == len(ranks) for r in live)
            and not s.get("operation")
        ):
            return s
        return None

    try:
        return wait_for(ok, timeout=timeout, interval=0.5, what=f"{name}: ranks {ranks} serving")
    except AssertionError as e:
        s = seen[0] if seen else {}
        shown = [
            (r["rank"], r["state"], r.get("dp_size"), (r.get("state_reason") or "")[:160]) for r in s.get("ranks", [])
        ]
        raise AssertionError(
            f"{e}; ranks {shown}; operation {s.get('operation')}; control {s.get('info', {}).get('control')}"
        ) from e


def pid_of(snap: dict[str, Any], rank: int) -> int:
    return int(next(r for r in snap["ranks"] if r["rank"] == rank)["pid"])


def operations(name: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in events(name)["operations"] if o.get("kind") == kind]


def controller_pid(name: str) -> int:
    """The controller actor's pid, once it answers (requests do not pass through the controller, so
    serving again after its SIGKILL does not mean Ray finished restarting it)."""
    from ray.exceptions import ActorUnavailableError

    import ray
    from engine_ext.ray.names import controller_name

    def ask() -> int | None:
        try:
            return int(ray.get(ray.get_actor(controller_name(name), namespace=NAMESPACE).pid.remote(), timeout=30))
        except ActorUnavailableError:  # being restarted by Ray
            return None

    return wait_for(ask, timeout=90, interval=0.5, what=f"{name}'s controller answering")


SPARE_S_PER_B = 4e-9  # the synthetic move's price of a byte landing in a member's spare buffer


def cost_plan(op_id: str = "op-1", **precopy: int) -> dict[str, Any]:
    """A 2 -> 4 plan, the cost model's other input: joiners 2 and 3 each receive 2 experts of 1 MiB
    from ranks 0 and 1; nothing in the commit; ``precopy`` adds the plan's maxima."""
    mib = 2**20
    pr = {
        "0": {"send": 2 * mib, "receive": 0, "spare": 0, "commit_moved": 0},
        "1": {"send": 2 * mib, "receive": 0, "spare": 0, "commit_moved": 0},
        "2": {"send": 0, "receive": 2 * mib, "spare": 0, "commit_moved": 0},
        "3": {"send": 0, "receive": 2 * mib, "spare": 0, "commit_moved": 0},
    }
    return {
        "op_id": op_id,
        "from_size": 2,
        "to_size": 4,
        "joining": [{"rank": 2, "instance_id": "d_dp2"}, {"rank": 3, "instance_id": "d_dp3"}],
        "precopy": {"per_rank": pr, **precopy},
    }


def cost_points(move: tuple[float, float], pause: tuple[float, float]) -> list[dict[str, Any]]:
    """Scale records (a cost model's input) exactly on move_s = a + b x total_moved_bytes +
    SPARE_S_PER_B x spare_total_bytes and pause_s = c + d x rank_expert_bytes."""
    out = []
    for mib, spare_mib in ((1, 0), (32, 8), (256, 0), (1024, 64)):
        moved, held, spare = mib * 2**20, mib * 2**20 // 2, spare_mib * 2**20
        out.append(
            {
                "total_moved_bytes": moved,
                "spare_total_bytes": spare,
                "rank_expert_bytes": held,
                "commit_load_bytes": 0,
                "move_s": move[0] + move[1] * moved + SPARE_S_PER_B * spare,
                "pause_s": pause[0] + pause[1] * held,
                "capture_policy": "reuse",
                "capture_sizes": [1, 2],
                "pool": True,
            }
        )
    return out


KNOWN_MOVE, KNOWN_PAUSE = (0.004, 2.5e-9), (0.018, 3.0e-11)  # the prices cost_points' records lie on, in tests


def assert_fit_recovers_known_prices(model: dict[str, Any]) -> None:
    """A model fitted to ``cost_points(KNOWN_MOVE, KNOWN_PAUSE)`` has those prices back (to rounding)."""
    import pytest

    mv, pz = model["move"], model["pause"]["reuse"]
    assert mv["intercept"] == pytest.approx(KNOWN_MOVE[0], rel=1e-9)
    assert mv["coef"]["total_moved_bytes"] == pytest.approx(KNOWN_MOVE[1], rel=1e-9)
    assert mv["coef"]["spare_total_bytes"] == pytest.approx(SPARE_S_PER_B, rel=1e-9)
    assert pz["intercept"] == pytest.approx(KNOWN_PAUSE[0], rel=1e-9)
    assert pz["coef"]["rank_expert_bytes"] == pytest.approx(KNOWN_PAUSE[1], rel=1e-9)


def write_cost_model(tmp_path: Path, model: dict[str, Any]) -> Path:
    """``model`` as the cost model file a deployment reads (EEPCTL_COST_MODEL names it)."""
    path = tmp_path / "cost_model.json"
    path.write_text(json.dumps(model))
    return path


def parse_source(source: str, filename: str = "<unknown>") -> Any:
    """``ast.parse``, tried again when CPython 3.11's AST converter trips on another thread of
    this process using it at the same time ("AST constructor recursion depth mismatch", gh-106905,
    fixed in later releases): a pytest worker runs Ray's and the tests' threads, and a traceback
    formatted on one of them parses source lines too."""
    import ast

    for attempt in range(5):
        try:
            return ast.parse(source, filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 4:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


def as_ray_task_error(refused: BaseException) -> BaseException:
    """``refused`` as a Ray actor call raises it: Ray's RayTaskError made an instance of the remote
    error's class too, its message the remote traceback (with class paths), the rank's own error as
    its ``cause``. Built here because a rank cannot be made to refuse on cue without a cluster."""

    class RayTaskErrorLike(type(refused)):  # type: ignore[misc]
        def __init__(self) -> None:
            Exception.__init__(
                self,
                f"ray::RankActor.call() (pid=1, repr=<engine_ext.ray.rank_actor.RankActor>)\n"
                f'  File "engine_ext/rank/engine.py", in add_request\n'
                f"{type(refused).__module__}.{type(refused).__name__}: {refused}",
            )
            self.__dict__.update(refused.__dict__)
            self.cause = refused

    return RayTaskErrorLike()
