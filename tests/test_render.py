"""The pure renderers against recorded-style records (tests/render_records.py): snapshot files
under tests/snapshots/ for the progress display, the 256-rank status, the 64-rank timeline and
their JSON. EEP_UPDATE_SNAPSHOTS=1 rewrites the files (review the diff before committing)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from eepctl import render
from eepctl.progress import ProgressModel, progress_text
from eepctl.render_text import human_bytes
from eepctl.timeline import rank_ranges, timeline, timeline_text
from engine_ext.control.registry_state import RegistryState
from tests.render_records import T0, big_status, history, rank_status, scale_events

SNAPSHOTS = Path(__file__).parent / "snapshots"
OP = "op-1700000000-abcd"


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    if os.environ.get("EEP_UPDATE_SNAPSHOTS") == "1" or not path.exists():
        path.write_text(text)
        if os.environ.get("EEP_UPDATE_SNAPSHOTS") != "1":
            pytest.fail(f"{name} did not exist; written now: review and commit it")
    assert text == path.read_text(), f"{name} differs (EEP_UPDATE_SNAPSHOTS=1 rewrites it after review)"


def _progress_at(now: float) -> ProgressModel:
    """A scale 56 -> 64 as the CLI sees it: at each poll the op record, then the events that
    ended since the last poll (events arrive when their phase ends)."""
    model = ProgressModel(started=T0)
    pending = sorted(scale_events(64, OP)["events"], key=lambda e: e["end"])
    op = {"op_id": OP, "from_size": 56, "to_size": 64, "state": "running"}
    polls = [(at, phase) for at, phase in ((0.1, "launch"), (2.6, "prepare"), (2.95, "commit")) if at <= now]
    for i, (at, phase) in enumerate(polls):
        model.on_operation({**op, "phase": phase}, now=T0 + at)
        until = T0 + (polls[i + 1][0] if i + 1 < len(polls) else now)
        while pending and pending[0]["end"] <= until:
            model.on_event(pending.pop(0))
    return model


def test_progress_mid_commit_shows_phases_ranks_and_pause_clock() -> None:
    text = progress_text(_progress_at(3.4), now=T0 + 3.4)
    check_snapshot("progress_commit.txt", text)
    lines = text.splitlines()
    assert lines[0].startswith(f"{OP}  DP 56 -> 64  running  elapsed 3.4s")
    names = [ln.split("│")[1].strip() for ln in lines if "│" in ln]
    assert names == ["launch", "prepare", "transfer", "commit", "reshuffle", "warm"]  # in order, rank phases nested
    commit = next(ln for ln in lines if "│ commit" in ln)
    assert commit.startswith(">") and "0/64" in commit  # the current phase, nobody done yet
    assert "serving paused for 0.5s" in text  # since the poll that saw commit (2.95 s)


def test_progress_size_does_not_grow_with_ranks_unless_verbose() -> None:
    model = _progress_at(3.4)
    plain = progress_text(model, now=T0 + 3.4)
    assert len(plain.splitlines()) < 15
    verbose = progress_text(model, now=T0 + 3.4, verbose=True)
    assert len(verbose.splitlines()) >= 64 + len(plain.splitlines())


def test_progress_after_the_end_shows_the_measured_pause_and_slowest_rank() -> None:
    model = _progress_at(4.0)
    for ev in scale_events(64, OP)["events"]:
        model.on_event(ev)
    model.on_operation(
        {"op_id": OP, "from_size": 56, "to_size": 64, "state": "succeeded", "phase": "cleanup", "serving_pause_s": 1.0},
        now=T0 + 4.0,
    )
    text = progress_text(model, now=T0 + 4.5)
    check_snapshot("progress_done.txt", text)
    assert "serving pause: 1000.0 ms" in text and "elapsed 4.0s" in text
    capture = next(ln for ln in text.splitlines() if "capture" in ln)
    assert "rank 13 (700 ms)" in capture and "64/64" in capture


def test_progress_phases_come_from_the_events_not_a_fixed_list() -> None:
    """A recovery's phases (another operation kind) show as they arrive."""
    model = ProgressModel(started=T0)
    for i, phase in enumerate(("detect", "abort", "regroup", "restore_experts")):
        model.on_event(
            {
                "op_id": "rec-1",
                "rank": -1,
                "phase": phase,
                "start": T0 + i,
                "end": T0 + i + 0.5,
                "outcome": "ok",
                "duration_s": 0.5,
            }
        )
    text = progress_text(model, now=T0 + 4.2)
    assert [ln.split("│")[1].strip() for ln in text.splitlines() if "│" in ln] == [
        "detect",
        "abort",
        "regroup",
        "restore_experts",
    ]
    assert next(ln for ln in text.splitlines() if "restore_experts" in ln).startswith(">")


def test_status_256_ranks_puts_attention_first_and_fits_the_screen() -> None:
    snap = big_status(256)
    text = render.status_text(snap, width=200, max_rows=10)
    check_snapshot("status_256.txt", text)
    rows = [ln for ln in text.splitlines() if ln.startswith("│")]
    assert [ln.split("│")[1].strip() for ln in rows[:3]] == ["200", "17", "0"]  # failed, draining, serving
    assert "... 246 more rank(s) not shown" in text
    assert "cpu-static 4 sizes 300 ms" in rows[2]
    assert "105 (2 STALE)" in text
    assert "eplb imbalance (max/mean rank load, recent window): 1.36" in text


def test_status_filters_by_state_and_node() -> None:
    snap = big_status(256)
    failed = render.filter_ranks(snap, ["failed,draining"], None)
    assert [r["rank"] for r in failed["ranks"]] == [17, 200]
    assert failed["summary"]["ranks"] == 256  # the summary still covers the deployment
    assert [r["rank"] for r in render.filter_ranks(snap, None, "node-3")["ranks"]] == list(range(24, 32))
    assert [r["rank"] for r in render.filter_ranks(snap, None, "10.0.3.1")["ranks"]] == list(range(24, 32))
    assert "showing 2 rank(s) matching the filters" in render.status_text(failed)


def test_status_json_keeps_raw_counts_and_per_size_times() -> None:
    snap = big_status(4)
    data = json.loads(render.to_json("status", snap))
    assert data["schema"] == 1 and data["object"] == "status"
    r0 = data["ranks"][0]
    assert r0["capture_times_s"] == {"1": 0.06, "2": 0.07, "4": 0.08, "8": 0.09}
    assert r0["last_capture_pass_s"] == 0.3 and r0["eplb_recent_load"][:2] == [10.0, 20.0]
    # 4 ranks x 4 slots, every expert twice: rank loads are each slot's tokens split over 2 replicas
    total = [10.0 + (e + 1) * 10 + 10.0 + (e + 1) * 10 for e in range(8)]
    loads = [sum(total[(r * 4 + i) % 8] / 2 for i in range(4)) for r in range(4)]
    assert data["eplb"]["rank_load"] == {str(r): pytest.approx(v) for r, v in enumerate(loads)}
    assert data["eplb"]["imbalance"] == pytest.approx(max(loads) / (sum(loads) / 4), abs=1e-4)
    assert data["eplb"]["rank_share"]["0"] == pytest.approx(loads[0] / sum(loads), abs=1e-4)


def test_no_load_shows_a_dash_not_zero() -> None:
    state = RegistryState("idle")
    for r in range(2):
        state.report_status(rank_status(r, 2, eplb_recent_load=[0.0] * 8))
    snap = state.snapshot()
    assert snap["eplb"]["imbalance"] is None
    text = render.status_text(snap)
    assert "– (no load)" in text and " –  " in text.replace("│", " ")


def test_capture_cell_for_each_kind() -> None:
    assert (
        render.capture_cell({"graph_kind": "cuda", "capture_sizes": [1, 2], "last_capture_pass_s": 0.012})
        == "cuda 2 sizes 12 ms"
    )
    assert render.capture_cell({"graph_kind": "none"}).startswith("n/a (eager vLLM")
    assert render.capture_cell({"graph_kind": "cpu-static", "capture_sizes": [1]}) == "cpu-static 1 sizes"


def test_rebuilding_registry_says_so_with_the_expected_count() -> None:
    state = RegistryState("big")
    state.set_info({"model": "m", "expected_ranks": 4})
    state.report_status(rank_status(0, 4))
    snap = state.snapshot()
    assert snap["rebuilding"] is True and snap["expected_ranks"] == 4 and snap["info"] == {"model": "m"}
    assert "registry rebuilding" in render.status_text(snap) and "1 of 4 rank(s)" in render.status_text(snap)
    for r in range(1, 4):
        state.report_status(rank_status(r, 4))
    assert state.snapshot()["rebuilding"] is False
    state.forget_rank(3)  # a later scale-down is not a rebuild
    assert state.snapshot()["rebuilding"] is False


def test_timeline_64_ranks_groups_and_marks() -> None:
    tl = timeline(scale_events(64, OP), OP)
    text = timeline_text(tl, width=120)
    check_snapshot("timeline_64.txt", text)
    labels = [ln.split("│")[0].strip() for ln in text.splitlines() if "│" in ln]
    assert labels == ["controller", "0-12,14-55 (x55)", "13 <- slowest", "56-63 (x8)", "serving pause"]
    assert tl["slowest_rank"] == 13
    assert tl["pause"] == {"start_s": 2.92, "end_s": 3.92, "duration_s": 1.0}


def test_timeline_json_has_every_span() -> None:
    data = scale_events(64, OP)
    tl = json.loads(render.to_json("timeline", timeline(data, OP)))
    assert tl["object"] == "timeline" and len(tl["spans"]) == len(data["events"])
    span = next(s for s in tl["spans"] if s["rank"] == 13 and s["phase"] == "capture")
    assert span == {"rank": 13, "phase": "capture", "start_s": 3.2, "end_s": 3.9, "duration_s": 0.7, "outcome": "ok"}
    assert sorted(r for g in tl["groups"] for r in g["ranks"]) == list(range(-1, 64))


def test_timeline_tolerance_splits_ranks_that_differ() -> None:
    tl: dict[str, Any] = timeline(scale_events(8, OP), OP, tolerance_s=0.0)
    assert [g["ranks"] for g in tl["groups"]] == [[-1], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert timeline({"events": []}, "op-x")["spans"] == []


# ---- eepctl events -----------------------------------------------------------------------------------
@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Times print in UTC: the snapshots must not depend on the machine's time zone."""
    import time

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _table_rows(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("│")]


@pytest.mark.parametrize("width", [80, 120, 160, 250])
def test_events_rows_are_one_line_with_a_short_id_and_a_kind(utc: None, width: int) -> None:
    """One line per operation at any width, the id's short form, a column saying which row was a
    scale, a recovery, the grow back or a rebuild; the error in full under the table."""
    from eepctl.events_query import select
    from eepctl.render_events import events_text

    data = select(history(6), 20)
    text = events_text(data, width=width)
    rows = _table_rows(text)
    assert [r.split("│")[1].strip() for r in rows] == ["a000", "a001", "a002", "a003", "a004", "a005"], text
    assert [r.split("│")[2].strip() for r in rows] == ["scale", "scale", "recovery", "grow", "rebuild", "scale"]
    assert all(len(ln) <= width for ln in text.splitlines() if ln.startswith(("┃", "│", "┏", "└"))), text
    assert (
        "a005 rolled_back: rank 3 failed in prepare: RuntimeError: gloo connection reset by peer while receiving "
        "expert 5 of layer 1 from rank 0"
    ) in " ".join(text.split())
    if width in (80, 250):  # each phase a column where they fit
        assert ("prepare" in text.splitlines()[2]) == (width == 250), text
    if width == 160:
        check_snapshot("events_history.txt", text)


def test_events_shows_the_last_n_operations_and_rank_events_only_when_asked(utc: None) -> None:
    from eepctl.events_query import select
    from eepctl.render_events import events_text

    data = select(history(6), 2)
    assert [o["op_id"][-4:] for o in data["operations"]] == ["a004", "a005"] and data["operations_total"] == 6
    assert {e["op_id"] for e in data["events"]} == {o["op_id"] for o in data["operations"]}
    text = events_text(data, width=160)
    assert "the last 2 of 6 operations (--last N shows more)" in text
    assert "rank 0     prepare" not in text and "18 phase event(s)" in text, text
    verbose = events_text(data, width=160, verbose=True)
    assert "a005 rank 3     commit                 ok       1.200s" in verbose
    every = events_text(select(history(6), None), width=160)
    assert "08:55:19 rank 2 fenced at epoch 4: silent for 7.0s (deadline 5s)" in every  # a fence, always
    assert "rank 0     prepare" not in every


def test_short_ids_are_unique_tails_and_op_takes_either_form() -> None:
    from eepctl.events_query import match_op, short_ids
    from engine_ext.protocol import UsageError

    ids = ["op-20261206-234027-f00c", "op-20261207-101010-f00c", "op-20261207-101011-ab12", "rec-1"]
    assert short_ids(ids) == {ids[0]: "234027-f00c", ids[1]: "101010-f00c", ids[2]: "ab12", "rec-1": "rec-1"}
    assert match_op(ids, "ab12") == ids[2] and match_op(ids, ids[0]) == ids[0]
    assert match_op(ids, "101010-f00c") == ids[1] and match_op(ids, "nope") == "nope"
    with pytest.raises(UsageError, match="--op f00c matches 2 operations"):
        match_op(ids, "f00c")


def test_timeline_gives_each_phase_its_own_letter() -> None:
    """prepare and precopy (and every phase a recovery or a vLLM hook reports) are told apart."""
    from eepctl.timeline import glyphs
    from engine_ext.protocol import REPORTED_PHASES, Phase

    known = [*REPORTED_PHASES, *(p.value for p in Phase), "prepare_warm_groups", "lock", "failure", "fence", "rebuild"]
    vllm = ["eplb_communicator", "switch", "release_graphs", "remove", "warmup", "capture_size", "warm+capture"]
    letters = glyphs([*dict.fromkeys(known), *vllm])
    assert len(set(letters.values())) == len(letters), letters
    data = scale_events(8, OP)
    data["events"].append({**data["events"][-1], "phase": "precopy", "rank": 0, "seq": 999})
    legend = timeline_text(timeline(data, OP), width=120).splitlines()[-1]
    assert "p=prepare" in legend and "y=precopy" in legend, legend


# ---- eepctl status -----------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [80, 100, 160])
def test_status_rows_stay_one_line_wide_with_standby_ranks(width: int) -> None:
    """Off a terminal (160 columns) and on narrow ones: one line per rank, the state a word, its
    reason under the table (a standby's is the standby pool line)."""
    state = RegistryState("h4")
    where = {"node_id": "b2741e82" + "0" * 48, "node_ip": "192.0.2.2"}
    for r in (0, 3, 4):
        state.report_status(rank_status(r, 3, instance_id=f"h4_dp{r}", engine_id=f"h4_dp{r}", **where))
    for n in (4, 5):
        state.report_status(
            rank_status(
                100000 + n,
                0,
                instance_id=f"h4_standby{n}",
                engine_id=f"h4_standby{n}",
                state="standby",
                state_reason=f"standby {n}: launched ahead, in no DP group",
                **where,
            )
        )
    state.report_status(
        rank_status(
            6,
            3,
            state="starting",
            state_reason="loading the model from the weight source",
            instance_id="h4_dp6",
            engine_id="h4_dp6",
            **where,
        )
    )
    snap = state.snapshot()
    text = render.status_text(snap, width=width)
    rows = _table_rows(text)
    assert len(rows) == 6 and all(len(r) <= width for r in rows), text
    assert {r.split("│")[3 if width < 160 else 4].strip() for r in rows} == {"serving", "standby", "starting"}, text
    assert "rank 6 starting: loading the model from the weight source" in text
    pool = "standby pool: 2 rank(s) launched ahead, in no DP group"
    assert pool in text and "launched ahead, in no DP group" not in text.replace(pool, "")
    held = snap["summary"]["standby_memory_bytes"]  # render_records' standby ranks hold 1.5 GiB and a few MiB each
    assert held == sum(r["memory_bytes"] for r in snap["ranks"] if r["state"] == "standby") > 3 << 30
    assert f"a scale-up adopts them as _dp<rank>; they hold {human_bytes(held)}" in " ".join(text.split())  # wrapped


def test_a_fence_shows_in_status_while_it_matters() -> None:
    """A fence is news for a minute, then only while its rank number is listed and not serving;
    `eepctl events` keeps every fence."""
    from eepctl.render_control import control_lines

    now = 10_000.0

    def lines(age: float, *ranks: dict[str, Any]) -> list[str]:
        fence = {"2": {"rank": 2, "epoch": 7, "reason": "silent for 7.0s (deadline 5s)", "at": now - age}}
        snap = {"ranks": list(ranks), "info": {"control": {"fenced": fence}}}
        return [ln for ln in control_lines(snap, now) if "fenced" in ln]

    assert lines(30) == ["rank 2 fenced at epoch 7 30s ago: silent for 7.0s (deadline 5s)"]
    assert lines(483) == []  # its rank number left the world
    assert lines(483, {"rank": 2, "state": "serving", "epoch": 8}) == []  # a replacement serves
    assert lines(483, {"rank": 2, "state": "starting", "epoch": 8}) != []  # ... not yet


# ---- scale progress off a terminal --------------------------------------------------------------------
@pytest.mark.parametrize("verbose", [False, True])
def test_scale_off_a_terminal_prints_rank_events_only_with_verbose(
    capsys: pytest.CaptureFixture[str], verbose: bool
) -> None:
    from eepctl.progress import ScaleProgress

    progress = ScaleProgress(json_lines=False, plain=True, verbose=verbose)
    evs = scale_events(64, OP)["events"]
    failed = {**evs[-1], "rank": 3, "phase": "failure", "outcome": "error", "detail": {"error": "oom"}}
    with progress:
        for ev in [*evs, failed]:
            progress.on_event(ev)
    lines = capsys.readouterr().err.splitlines()
    controller = [e for e in evs if e["rank"] == -1]
    assert len(lines) == (len(evs) + 1 if verbose else len(controller) + 1), lines[:8]
    assert lines[-1].endswith("error=oom")  # a rank's failure is always shown


def test_a_scale_left_running_says_how_to_follow_it_with_its_target() -> None:
    from eepctl.options import target_flags

    flags = target_flags("prod", "team-a", "10.0.0.1:6379")
    assert flags == " --name prod --namespace team-a --address 10.0.0.1:6379"
    assert target_flags("moe", "eepctl", None) == " --name moe"
    text = render.scale_text({"op_id": "op-1", "state": "running"}, flags)
    assert text == (
        "op-1 accepted; follow it with: eepctl events --name prod --namespace team-a "
        "--address 10.0.0.1:6379 --op op-1 --follow\n"
    )


def test_ranks_sharing_a_gpu_without_mps_are_named_in_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that report one physical GPU and no MPS daemon get a line saying they serve less than
    one rank; with MPS up (the rank finds its control pipe), or on GPUs of their own, nothing."""
    import torch

    from engine_ext.rank.device_info import mps_active

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert mps_active(torch.device("cuda:0")) is False and mps_active(torch.device("cpu")) is None
    (tmp_path / "control").touch()  # where the daemon's pipe lives while it runs
    assert mps_active(torch.device("cuda:0")) is True

    def snap(uuids: list[str], mps: bool) -> dict[str, Any]:
        state = RegistryState("gpu")
        for r, uuid in enumerate(uuids):
            state.report_status(
                rank_status(r, len(uuids), device="cuda:0", device_uuid=uuid, mps=mps, node_ip="10.0.0.1")
            )
        return state.snapshot()

    shared = [ln for ln in render.status_summary_lines(snap(["GPU-a"] * 3 + ["GPU-b"], False)) if "MPS" in ln]
    assert shared == [
        "ranks 0,1,2 share one GPU (cuda:0 on 10.0.0.1) without MPS: their kernels take turns, so "
        "together they serve less than one rank; start `nvidia-cuda-mps-control -d` on that node "
        "before the ranks"
    ], shared
    assert not [ln for ln in render.status_summary_lines(snap(["GPU-a"] * 4, True)) if "MPS" in ln]
    assert not [ln for ln in render.status_summary_lines(snap(["GPU-a", "GPU-b"], False)) if "MPS" in ln]


def test_down_says_what_it_gave_back_of_vllms_held_prepare() -> None:
    base = {"deployment": "d", "stopped": True, "cluster_stopped": False, "removed_by_name": []}
    assert render.down_text(dict(base, released=None)) == "deployment d stopped\n"
    dropped = {"prepared_dp": 4, "dropped": True, "drop_s": 0.8}
    assert render.down_text(dict(base, released=dropped)) == (
        "deployment d stopped; the engine core(s) vLLM held prepared for DP 4 dropped\n"
    )
    held = {"prepared_dp": 3, "dropped": False, "error": "did not hold 0 engine core(s) prepared within 120s"}
    text = render.down_text(dict(base, released=held))
    assert "still holds engine core(s) prepared for DP 3 (did not hold 0" in text and text.count("\n") == 1
