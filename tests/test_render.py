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
from eepctl.timeline import rank_ranges, timeline, timeline_text
from engine_ext.control.registry_state import RegistryState
from tests.render_records import T0, big_status, rank_status, scale_events

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
    model.on_operation({"op_id": OP, "from_size": 56, "to_size": 64, "state": "succeeded", "phase": "cleanup",
                        "serving_pause_s": 1.0}, now=T0 + 4.0)
    text = progress_text(model, now=T0 + 4.5)
    check_snapshot("progress_done.txt", text)
    assert "serving pause: 1000.0 ms" in text and "elapsed 4.0s" in text
    capture = next(ln for ln in text.splitlines() if "capture" in ln)
    assert "rank 13 (700 ms)" in capture and "64/64" in capture


def test_progress_phases_come_from_the_events_not_a_fixed_list() -> None:
    """A recovery's phases (another operation kind) show as they arrive."""
    model = ProgressModel(started=T0)
    for i, phase in enumerate(("detect", "abort", "regroup", "restore_experts")):
        model.on_event({"op_id": "rec-1", "rank": -1, "phase": phase, "start": T0 + i, "end": T0 + i + 0.5,
                        "outcome": "ok", "duration_s": 0.5})
    text = progress_text(model, now=T0 + 4.2)
    assert [ln.split("│")[1].strip() for ln in text.splitlines() if "│" in ln] == \
        ["detect", "abort", "regroup", "restore_experts"]
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
    assert render.capture_cell({"graph_kind": "cuda", "capture_sizes": [1, 2], "last_capture_pass_s": 0.012}) \
        == "cuda 2 sizes 12 ms"
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
