"""Fuzzing with hypothesis: CLI arguments and registry inputs.

Contracts checked here:
- CLI: any argv ends in a documented exit code with at most one line of error text, never a
  traceback. No cluster is reachable (RAY_ADDRESS points at a dead port, the state dir is empty),
  so well-formed commands exit 3 and nothing is started.
- Registry intake (RegistryState.report_status / report_event / record_operation): a record is
  either accepted or refused with a ValueError/TypeError (unknown keys included: they are refused,
  docs/status-schema.md); either way the state stays valid: snapshot(), operations() and
  events_for() keep working, print as plain JSON and carry exactly the documented fields.
- The Ray registry actor keeps serving after a stream of hostile reports.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_ext.control.registry_state import RegistryState
from engine_ext.records import Event, Operation, rank_status_type

DOCUMENTED = {0, 2, 3, 4, 5, 6}

# ---- CLI -------------------------------------------------------------------------------------------
COMMANDS = ["up", "down", "status", "generate", "scale", "events", "completion"]
OPTIONS = [
    "--dp",
    "--max-dp",
    "--name",
    "-n",
    "--namespace",
    "--address",
    "-o",
    "--output",
    "--dry-run",
    "--no-wait",
    "--drain-timeout",
    "--timeout",
    "--watch",
    "-w",
    "--interval",
    "--op",
    "--follow",
    "-f",
    "--prompt-ids",
    "-p",
    "--max-tokens",
    "--rate",
    "--duration",
    "--stop-cluster",
    "--api-key",
    "--experts",
    "--slots-per-rank",
    "--top-k",
    "--layers",
    "--hidden",
    "--dtype",
    "--seed",
    "--cpus-per-rank",
    "--gpus-per-rank",
    "--help",
    "-h",
    "--",
    "-",
    "--nope",
    "-x",
]
VALUES = [
    "0",
    "1",
    "2",
    "4",
    "-1",
    "9999999999999999999999",
    "x",
    "1.5",
    "nan",
    "inf",
    "-inf",
    "",
    " ",
    "json",
    "table",
    "JSON",
    "yaml",
    "moe",
    "compl-a",
    "../x",
    "a b",
    "A",
    "-" * 41,
    "bash",
    "zsh",
    "fish",
    "tcsh",
    "1,2,3",
    "1,,x",
    "float32",
    "bfloat16",
    "int8",
    "\x00",
    "é",
    "\udcff",
    "%s%n",
    "'; rm -rf /",
]
# --address values: only dead or unparsable ones, so no example can reach a real cluster.
DEAD_ADDRESSES = ["127.0.0.1:1", "ray://127.0.0.1:1", "nohostport", ":", "127.0.0.1:", "[::1]:1", "auto"]

token = st.one_of(
    st.sampled_from(COMMANDS),
    st.sampled_from(OPTIONS),
    st.sampled_from(VALUES),
    st.text(max_size=12),
    st.integers(-10, 10).map(str),
    st.sampled_from(OPTIONS).flatmap(lambda o: st.sampled_from(VALUES).map(lambda v: f"{o}={v}")),
)


@st.composite
def argv_strategy(draw: Any) -> list[str]:
    head = draw(st.one_of(st.sampled_from(COMMANDS).map(lambda c: [c]), st.just([]), st.lists(token, max_size=1)))
    rest = draw(st.lists(token, max_size=8))
    argv = head + rest
    # Never a dead address replaced by a live one: any --address gets a dead value.
    out: list[str] = []
    for a in argv:
        if a.startswith("--address="):
            a = "--address=" + draw(st.sampled_from(DEAD_ADDRESSES))
        out.append(a)
        if a == "--address":
            out.append(draw(st.sampled_from(DEAD_ADDRESSES)))
    return out


def _run(argv: list[str]) -> tuple[int, str, str]:
    from eepctl.main import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run(argv)
        except SystemExit as e:  # click's own exits (none expected with standalone_mode=False)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing reachable: a dead RAY_ADDRESS and an empty state dir (so no recorded local cluster)."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("EEPCTL_STATE_DIR", str(tmp_path / "state"))
    for var in ("EEPCTL_DEBUG", "EEPCTL_NAME", "EEPCTL_NAMESPACE", "VLLM_API_KEY", "_EEPCTL_COMPLETE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(argv=argv_strategy())
def test_cli_argv_fuzz(no_cluster: None, argv: list[str]) -> None:
    if "--debug" in argv or "--traceback" in argv:
        return  # --debug re-raises with the traceback by design
    code, out, err = _run(argv)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    assert code in DOCUMENTED, f"eepctl {argv!r} exited {code}: {err!r}"
    if code != 0:
        assert err.startswith("eepctl: ") or err == "", (argv, err)
        assert err.count("\n") <= 1, (argv, err)


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--dp", "1"],
        ["up", "--dp", "1", "--address", "127.0.0.1:1"],
        ["status"],
        ["status", "-o", "json"],
        ["down"],
        ["down", "--stop-cluster"],
        ["events"],
        ["scale", "--dp", "2"],
        ["scale", "--dp", "2", "--dry-run"],
        ["generate"],
    ],
)
def test_well_formed_commands_exit_3_without_a_cluster(no_cluster: None, argv: list[str]) -> None:
    """With RAY_ADDRESS at a dead address nothing connects and nothing starts: `up` included (it starts
    a local head only when no address resolves at all)."""
    t0 = time.time()
    code, out, err = _run(argv)
    assert code == 3, (argv, code, err)
    assert err.startswith("eepctl: ") and "Traceback" not in err
    assert time.time() - t0 < 30


def test_up_does_not_start_a_cluster_at_a_dead_address(no_cluster: None, tmp_path: Path) -> None:
    code, _, err = _run(["up", "--dp", "1", "--name", "fuzz-up"])
    assert code == 3, err
    assert "127.0.0.1:1" in err
    assert not (tmp_path / "state" / "local-cluster.json").exists()


# ---- registry intake ----------------------------------------------------------------------------
def _valid_status(rank: int = 0, **over: Any) -> dict[str, Any]:
    st_ = {
        "deployment": "fz",
        "rank": rank,
        "instance_id": f"fz_dp{rank}",
        "engine_id": f"fz_dp{rank}",
        "state": "serving",
        "dp_size": 2,
        "requests_running": 1,
        "requests_waiting": 0,
        "last_heartbeat": time.time(),
    }
    st_.update(over)
    return st_


def _valid_event(**over: Any) -> dict[str, Any]:
    ev = {"op_id": "op-1", "rank": 0, "phase": "transfer", "start": 1.0, "end": 2.0, "outcome": "ok", "detail": {}}
    ev.update(over)
    return ev


def _valid_op(**over: Any) -> dict[str, Any]:
    op = {
        "op_id": "op-1",
        "deployment": "fz",
        "from_size": 1,
        "to_size": 2,
        "state": "running",
        "phase": "plan",
        "started": 1.0,
        "finished": None,
        "phase_durations": {"plan": 0.1},
    }
    op.update(over)
    return op


class Weird:
    def __str__(self) -> str:
        return "weird"


junk_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**200), 2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=10),
    st.just("x" * 200_000),
    st.just(float("nan")),
    st.just(-1),
    st.just(-(10**6)),
    st.builds(Weird),
    st.sampled_from(["serving", "removed", "stale", "failed", "capture", "warm", "op-1", "fz_dp0", "fz_dp0_dp0"]),
)
junk = st.recursive(
    junk_scalar,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(), st.tuples(st.integers())), children, max_size=4),
    ),
    max_leaves=12,
)


def hostile(valid: Any) -> Any:
    """Records near a valid one: fields replaced by junk, removed, or junk keys added; or no mapping at all."""

    @st.composite
    def build(draw: Any) -> Any:
        base = dict(valid())
        keys = list(base)
        for k in draw(st.lists(st.sampled_from(keys), max_size=4, unique=True)):
            base[k] = draw(junk)
        for k in draw(st.lists(st.sampled_from(keys), max_size=2, unique=True)):
            if draw(st.booleans()):
                base.pop(k, None)
        for k, v in draw(
            st.dictionaries(
                st.one_of(
                    st.text(max_size=10),
                    st.sampled_from(["received_at", "heartbeat_age_s", "seq", "duration_s", "detail", "plan"]),
                ),
                junk,
                max_size=3,
            )
        ).items():
            base[k] = v
        if draw(st.booleans()) and draw(st.booleans()):
            base[draw(st.sampled_from([1, None, (1, 2), 2.5]))] = draw(junk)
        return base

    return st.one_of(build(), build(), build(), junk)


def _intake(fn: Any, record: Any) -> bool:
    try:
        fn(record)
        return True
    except (ValueError, TypeError):
        return False  # the documented refusal


def _assert_state_valid(state: RegistryState) -> dict[str, Any]:
    """Every view prints as JSON with no fallback, and every record in it has exactly its fields."""
    snap = state.snapshot()
    ops, events = state.operations(), state.events_for()
    json.dumps([snap, ops, events, state.violations()])
    s = snap["summary"]
    assert isinstance(s["requests_running"], int) and isinstance(s["requests_waiting"], int)
    assert s["ranks"] == len(snap["ranks"]) == sum(s["by_state"].values())
    for r in snap["ranks"]:
        assert set(r) == set(rank_status_type(r["kind"]).__struct_fields__), sorted(r)
        assert isinstance(r["rank"], int) and r["rank"] >= 0 and isinstance(r["state"], str)
    for op in ops:
        declared = set(Operation.__struct_fields__)
        assert declared - {"deadline", "rank_ops", "warmups_per_rank"} <= set(op) <= declared  # vLLM's only
    assert [e["seq"] for e in events] == sorted({e["seq"] for e in events})
    for e in events:
        assert set(e) == {*Event.__struct_fields__, "seq"}
        assert e["duration_s"] == round(max(0.0, e["end"] - e["start"]), 6) and e["rank"] >= -1
    return snap


def _contents(state: RegistryState) -> tuple[Any, ...]:
    return (
        dict(state.ranks),
        dict(state.received_at),
        dict(state.ops),
        list(state.events),
        state.seq,
        list(state.rejected),
    )


hostile_call = st.one_of(
    st.tuples(st.just("status"), hostile(_valid_status)),
    st.tuples(st.just("event"), hostile(_valid_event)),
    st.tuples(st.just("op"), hostile(_valid_op)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(hostile_call, min_size=1, max_size=12))
def test_registry_intake_survives_hostile_records(calls: list[tuple[str, Any]]) -> None:
    state = RegistryState("fz")
    state.report_status(_valid_status(0))
    state.report_event(_valid_event())
    state.record_operation(_valid_op())
    fns = {"status": state.report_status, "event": state.report_event, "op": state.record_operation}
    for kind, record in calls:
        before = _contents(state)
        if not _intake(fns[kind], record):
            assert _contents(state) == before, f"a refused {kind} changed the registry"
        _assert_state_valid(state)
    # still takes good reports afterwards
    assert state.report_status(_valid_status(1, instance_id="fz_dp1b", engine_id="fz_dp1b")) == {"accepted": True}
    state.report_event(_valid_event(op_id="op-after", start=5.0, end=6.0))
    state.record_operation(_valid_op(op_id="op-after", started=7.0))
    snap = _assert_state_valid(state)
    assert any(o["op_id"] == "op-after" for o in state.operations())
    assert any(e["op_id"] == "op-after" for e in state.events_for())
    assert snap["ranks"]


@pytest.mark.parametrize(
    "record",
    [
        None,
        42,
        "status",
        [1, 2],
        {},
        _valid_status(rank="x"),
        _valid_status(rank=float("nan")),
        _valid_status(rank=float("inf")),
        _valid_status(rank=-3),
        _valid_status(requests_running="many"),
        _valid_status(requests_running=float("nan")),
        _valid_status(state=["serving"]),
        _valid_status(instance_id={"a": 1}),
        _valid_status(engine_id=7),
        _valid_status(workspace_bytes="1GB", workspace_locked=True, workspace_required_bytes=10),
        _valid_status(capture_sizes="1,2"),
        _valid_status(x="y" * (2 << 20)),
        _valid_status(rank=True),
        _valid_status(requests_running=2.0),
        _valid_status(requests_running="2"),
        _valid_status(extra_field=1),
        _valid_status(kv_usage=0.5),  # a vLLM-only field on a reference rank
        {**_valid_status(), (1, 2): "tuple key"},
        _valid_status(nested={(1,): "tuple key inside"}),
    ],
)
def test_hostile_status_is_refused_with_value_or_type_error(record: Any) -> None:
    state = RegistryState("fz")
    with pytest.raises((ValueError, TypeError)):
        state.report_status(record)
    assert state.snapshot()["ranks"] == []


@pytest.mark.parametrize(
    "record",
    [
        None,
        "ev",
        {},
        _valid_event(op_id=["x"]),
        _valid_event(rank="0"),
        _valid_event(start="1"),
        _valid_event(end=float("nan")),
        _valid_event(phase={"p": 1}),
        _valid_event(detail="warm"),
        _valid_event(rank=-2),
        _valid_event(seq=3),
        _valid_event(detail={"x": b"1" * (1 << 20)}),
        _valid_event(detail={"k": Weird()}),
    ],
)
def test_hostile_event_is_refused(record: Any) -> None:
    state = RegistryState("fz")
    with pytest.raises((ValueError, TypeError)):
        state.report_event(record)
    assert state.events_for() == [] and state.seq == 0


@pytest.mark.parametrize(
    "record",
    [
        None,
        [("op_id", "x")],
        {},
        _valid_op(op_id=None),
        _valid_op(op_id=["x"]),
        _valid_op(started="yesterday"),
        _valid_op(started=float("nan")),
        _valid_op(phase_durations="fast"),
        _valid_op(phase_durations={"warm": "1s"}),
        _valid_op(state=3),
        {"op_id": "bare"},
        _valid_op(surprise=1),
        _valid_op(finished=float("inf")),
    ],
)
def test_hostile_operation_is_refused(record: Any) -> None:
    state = RegistryState("fz")
    with pytest.raises((ValueError, TypeError)):
        state.record_operation(record)
    assert state.ops == {}


def test_valid_records_accepted_with_their_documented_leniency() -> None:
    """What real ranks send keeps working: str enums for strings, ints for floats, tuples for lists,
    None for a field with a default (meaning the default); a vLLM rank's own fields under kind "vllm"."""
    from engine_ext.protocol import RankState

    state = RegistryState("fz")
    rec = _valid_status(
        0,
        state=RankState.SERVING,
        last_heartbeat=int(time.time()),
        node=None,
        last_capture_s=None,
        capture_sizes=(1, 2),
    )
    assert state.report_status(rec) == {"accepted": True}
    vllm = _valid_status(
        1, kind="vllm", kv_usage=0.25, hooks={"a": "active"}, hook_calls={"m": {"calls": 2, "total_s": 0.5}}
    )
    assert state.report_status(vllm) == {"accepted": True}
    r0, r1 = state.snapshot()["ranks"]
    assert r0["state"] == "serving" and type(r0["state"]) is str and isinstance(r0["last_heartbeat"], float)
    assert r0["node"] == "" and r0["last_capture_s"] is None and r0["capture_sizes"] == [1, 2]
    assert "kv_usage" not in r0 and r1["kv_usage"] == 0.25 and r1["hook_calls"] == {"m": {"calls": 2, "total_s": 0.5}}
    assert state.snapshot()["summary"]["by_state"] == {"serving": 2}
    state.report_event(_valid_event(rank=-1, phase="plan", start=1, end=1.5, duration_s=99))
    assert [e["duration_s"] for e in state.events_for()] == [0.5], "duration_s is computed, never taken"
    state.record_operation({"op_id": "bare", "deployment": "fz", "from_size": 1, "to_size": 2, "started": 5})
    assert [(o["op_id"], o["state"], o["started"]) for o in state.operations()] == [("bare", "running", 5.0)]


def test_refusals_say_what_is_wrong() -> None:
    state = RegistryState("fz")
    with pytest.raises(ValueError, match="status: Object contains unknown field `extra_field`"):
        state.report_status(_valid_status(extra_field=1))
    with pytest.raises(ValueError, match=r"event: Expected `float`.*\$\.end"):
        state.report_event(_valid_event(end=float("nan")))
    with pytest.raises(ValueError, match="operation: Object missing required field `deployment`"):
        state.record_operation({"op_id": "bare"})
    with pytest.raises(ValueError, match="event is .* bytes, over the 1048576 byte limit"):
        state.report_event(_valid_event(detail={"x": "y" * (1 << 20)}))


# ---- the Ray registry actor ----------------------------------------------------------------------
@pytest.mark.ray
def test_registry_actor_keeps_serving_after_hostile_reports(ray_cluster: dict) -> None:
    import ray
    from engine_ext.ray.registry import Registry

    if not ray.is_initialized():
        ray.init(address=ray_cluster["address"], namespace="eepctl-fuzz", logging_level="ERROR", log_to_driver=False)
    name = f"fuzz-registry-{uuid.uuid4().hex[:8]}"
    actor = ray.remote(Registry).options(name=name, namespace="eepctl-fuzz", num_cpus=0).remote("fz")
    try:
        ray.get(actor.report_status.remote(_valid_status(0)), timeout=60)
        samples = [
            None,
            1,
            "x",
            [1],
            {},
            _valid_status(rank="x"),
            _valid_status(rank=float("nan")),
            _valid_status(requests_running="many"),
            _valid_status(state=["serving"]),
            _valid_status(x="y" * 300_000),
            _valid_status(rank=-5),
            {**_valid_status(), 3: "int key"},
            _valid_status(nested={(1,): 2}),
            _valid_status(rank=1, instance_id="fz_dp0"),
        ]
        events = [
            None,
            "e",
            [None],
            [_valid_event(detail="x")],
            [_valid_event(rank="0"), _valid_event(op_id="ok-2")],
            [_valid_event(start=float("inf"))],
            [{"op_id": ["x"]}],
        ]
        ops = [None, {}, [1], _valid_op(op_id=None), _valid_op(started="x"), _valid_op(phase_durations={"w": "x"})]
        fire = []
        errors = 0
        for i in range(100):
            kind = i % 3
            if kind == 0:
                call = actor.report_status.remote(samples[i % len(samples)])
            elif kind == 1:
                call = actor.report_events.remote(events[i % len(events)])
            else:
                call = actor.record_operation.remote(ops[i % len(ops)])
            if i % 2:
                fire.append(call)  # fire and forget, as ranks do
            else:
                try:
                    ray.get(call, timeout=60)
                except Exception:  # noqa: BLE001 - a refused record surfaces as a task error
                    errors += 1
        snap = ray.get(actor.snapshot.remote(), timeout=60)
        json.dumps(snap)
        assert [r["rank"] for r in snap["ranks"]] == [0]
        assert ray.get(actor.ping.remote(), timeout=60) == "fz"
        ev = ray.get(actor.events.remote(), timeout=60)
        json.dumps(ev)
        assert any(e["op_id"] == "ok-2" for e in ev["events"]), "a bad event dropped the good one beside it"
        print(f"\n{errors} of 50 awaited hostile reports were refused with an error; the actor kept serving")
        del fire
    finally:
        ray.kill(actor, no_restart=True)
