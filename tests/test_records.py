"""The typed records (engine_ext.records) and the one JSON-lines shape eepctl streams.

No cluster: records are built, turned into builtins and back, and the scale progress of
`eepctl scale -o json` is written to a captured stdout.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from eepctl.progress import ScaleProgress
from eepctl.render import to_json
from engine_ext.records import Event, Operation, RankStatus, VllmRankStatus, from_builtins, to_builtins


@pytest.mark.parametrize(
    "record",
    [
        RankStatus(
            deployment="d",
            rank=1,
            instance_id="d_dp1",
            engine_id="d_dp1",
            capture_sizes=[1, 2],
            last_capture_s=0.25,
            eplb_logical_load=[1.0, 3.0],
        ),
        VllmRankStatus(
            deployment="d",
            rank=0,
            instance_id="d_dp0",
            engine_id="d_dp0",
            kv_usage=0.5,
            hook_calls={"m": {"calls": 3, "total_s": 0.5}},
            hooks={"m": "active"},
        ),
        Event("op-1", -1, "plan", 10.0, 10.5, "ok", {"moves": [1, 2]}),
        Operation("op-1", "d", 1, 2, phase_durations={"plan": 0.5}, plan={"layout": {"world_size": 2}}),
        Operation("op-2", "d", 2, 1, deadline=99.0, rank_ops=["vllm-dp1-1"]),
    ],
)
def test_records_survive_json_and_back(record: Any) -> None:
    """What a rank sends is what the registry reads: through JSON text and back, nothing changes."""
    data = json.loads(json.dumps(to_builtins(record)))
    assert from_builtins(data, type(record)) == record
    assert list(data) == [f for f in type(record).__struct_fields__ if f in data]


def test_event_json_carries_its_computed_duration() -> None:
    data = to_builtins(Event("op-1", 0, "warm", 1.0, 1.25))
    assert data["duration_s"] == 0.25 and data["detail"] == {} and data["outcome"] == "ok"


def test_vllm_only_operation_fields_are_absent_from_a_reference_operation() -> None:
    data = to_builtins(Operation("op-1", "d", 1, 2))
    assert "deadline" not in data and "rank_ops" not in data and data["finished"] is None


def test_scale_progress_json_lines_use_the_envelope(capsys: pytest.CaptureFixture[str]) -> None:
    ev = to_builtins(Event("op-1", 0, "transfer", 1.0, 2.0))
    with ScaleProgress(json_lines=True, plain=True) as progress:
        progress.on_event({**ev, "seq": 4})
        progress.on_event({**ev, "phase": "warm", "seq": 5})
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(ln["schema"], ln["object"], ln["phase"], ln["seq"]) for ln in lines] == [
        (1, "event", "transfer", 4),
        (1, "event", "warm", 5),
    ]
    assert lines[0]["duration_s"] == 1.0 and "kind" not in lines[0]


def test_every_json_line_object_is_named_by_the_envelope() -> None:
    for kind, data in [
        ("status", {"deployment": "d", "ranks": []}),
        ("event", {"op_id": "op-1"}),
        ("operation", {"op_id": "op-1"}),
        ("scale", {"op_id": "op-1"}),
    ]:
        line = to_json(kind, data)
        assert "\n" not in line
        assert json.loads(line) == {"schema": 1, "object": kind, **data}
