"""Issue 35 point 1, in process: what a vLLM worker records of its warm-up and capture passes, and
how the registry merges the worker's own record into its engine core's.

The capture hooks wrap vLLM's GPU model runner (``capture_model`` and its per-size
``_warmup_and_capture``), which cannot run on this CPU-only host; here the plugin's real wrappers
(``patches.make_wrapper`` with the catalogue's own specs) wrap stand-in methods that call each
other as vLLM's do, so the sink's counting is driven exactly as on a GPU worker. The live paths
(``uni`` in tests/test_vllm_plugin.py, Ray workers in tests/test_vllm_elastic.py) run vLLM itself.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

from engine_ext.control.registry_state import RegistryState
from engine_ext.vllm import patches
from engine_ext.vllm.registry_link import Settings
from engine_ext.vllm.telemetry import VllmTelemetry
from engine_ext.vllm.worker_reporter import WorkerReporter, executor_name


def _spec(key: str) -> patches.PatchSpec:
    return next(s for s in patches.CATALOGUE if s.key == key)


class _Runner:
    """Calls between the methods as vLLM's GPU worker and model runner make them."""

    def __init__(self, sizes: list[int]) -> None:
        pc = SimpleNamespace(data_parallel_rank=1, data_parallel_size=2)
        cc = SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8])
        self.vllm_config = SimpleNamespace(
            parallel_config=pc, compilation_config=cc, model_config=SimpleNamespace(enforce_eager=False)
        )
        self.device = "cuda:0"
        self.sizes = sizes

    def compile_or_warm_up_model(self) -> None:  # gpu_worker.Worker's: warm-up, then capture_model()
        CAPTURE(self)

    def capture_model(self) -> int:  # gpu_model_runner: one _warmup_and_capture per descriptor
        for n in self.sizes:
            SIZE(self, SimpleNamespace(num_tokens=n), "FULL", None, False, None, None)
        return 1 << 20

    def _warmup_and_capture(self, desc: Any, mode: Any, *rest: Any) -> None:
        time.sleep(0.002 * desc.num_tokens)


SINK = VllmTelemetry()
WARMUP = patches.make_wrapper(_spec("Worker.compile_or_warm_up_model"), _Runner.compile_or_warm_up_model, SINK)
CAPTURE = patches.make_wrapper(_spec("GPUModelRunner.capture_model"), _Runner.capture_model, SINK)
SIZE = patches.make_wrapper(_spec("GPUModelRunner._warmup_and_capture"), _Runner._warmup_and_capture, SINK)
RELEASE = patches.make_wrapper(_spec("ElasticEPScalingExecutor._release_cuda_graphs"), lambda self: None, SINK)


def test_capture_passes_are_counted_where_they_run_with_per_size_timings() -> None:
    seen: list[Any] = []
    SINK.on_worker = seen.append
    runner = _Runner([8, 4, 2, 1])
    WARMUP(runner)
    snap, events = SINK.snapshot(), SINK.drain_events()
    assert seen == [runner]  # the reporter starts when the worker is first seen
    assert (snap["warmups_total"], snap["captures_total"], snap["last_op"]) == (1, 1, "startup")
    assert set(snap["capture_times_s"]) == {"1", "2", "4", "8"}
    assert snap["capture_times_s"]["8"] >= 0.016 and snap["capture_times_s"]["8"] > snap["capture_times_s"]["1"]
    assert snap["last_capture_pass_s"] >= sum(snap["capture_times_s"].values())
    assert snap["last_warmup_s"] >= snap["last_capture_pass_s"]
    assert (snap["graph_kind"], snap["capture_sizes"], snap["graphs_captured"]) == ("cuda", [1, 2, 4, 8], 4)
    assert snap["capture_sizes_expected"] == [1, 2, 4, 8] and snap["rank"] == 1 and snap["dp_size"] == 2
    # One event per pass (none per size): the capture inside the warm-up, then the warm-up.
    assert [(e["phase"], e["rank"]) for e in events] == [("capture", 1), ("warmup", 1)]
    assert events[0]["detail"]["capture_pass"] == 1 and set(events[0]["detail"]["sizes_s"]) == {"1", "2", "4", "8"}

    # vLLM's capture_model returns at once when its cudagraph mode is NONE: not a capture pass.
    runner.sizes = []
    WARMUP(runner)
    snap, events = SINK.snapshot(), SINK.drain_events()
    assert (snap["warmups_total"], snap["captures_total"], snap["graphs_captured"]) == (2, 1, 4)
    assert [e["phase"] for e in events] == ["warmup"]
    RELEASE(runner)  # the elastic release drops the graphs; an operation begins
    snap = SINK.snapshot()
    assert snap["graphs_captured"] == 0 and snap["capture_sizes"] == [] and snap["last_op"].startswith("vllm-")
    runner.sizes = [2, 1]
    WARMUP(runner)
    WARMUP(runner)
    snap = SINK.snapshot()
    assert (snap["captures_this_op"], snap["warmups_this_op"], snap["captures_total"]) == (2, 2, 3)
    assert set(snap["capture_times_s"]) == {"1", "2"}  # the last pass's sizes
    # What the worker's reporter thread sends is a record the registry takes (unknown keys are refused).
    reporter = WorkerReporter(Settings(deployment="v", namespace="eepctl", address="auto"), SINK)
    reporter.executor = executor_name(runner.vllm_config)
    state = RegistryState("v", kind="vllm")
    assert state.report_worker(reporter.record()) == {"accepted": True}
    assert state.workers[1][0].captures_total == 3 and state.workers[1][0].node == reporter.node


def _core(rank: int, started: float, **kw: Any) -> dict[str, Any]:
    return {
        "deployment": "v",
        "rank": rank,
        "kind": "vllm",
        "instance_id": f"i_dp{rank}",
        "engine_id": "",
        "state": "serving",
        "dp_size": 2,
        "pid": 100 + rank,
        "started": started,
        "last_heartbeat": time.time(),
        "workspace_note": "no report from this rank's worker yet",
        **kw,
    }


def _worker(rank: int, started: float, **kw: Any) -> dict[str, Any]:
    return {
        "deployment": "v",
        "rank": rank,
        "dp_size": 2,
        "executor": "ray",
        "pid": 200 + rank,
        "started": started,
        "last_heartbeat": time.time(),
        "workspace_available": True,
        "workspace_bytes": 4096,
        "workspace_locked": True,
        "captures_total": 1,
        "warmups_total": 1,
        "last_warmup_s": 0.5,
        "capture_times_s": {"1": 0.01},
        "last_capture_pass_s": 0.02,
        "graph_kind": "cuda",
        "graphs_captured": 1,
        "capture_sizes": [1],
        **kw,
    }


def test_the_registry_merges_each_workers_own_record_into_its_ranks() -> None:
    state = RegistryState("v", kind="vllm")
    t0 = time.time()
    for rank in (0, 1):
        assert state.report_status(_core(rank, t0))["accepted"]
    state.report_worker(_worker(0, t0 + 2))
    state.report_worker(_worker(1, t0 - 60, workspace_bytes=1))  # an earlier process that held rank 1
    r0, r1 = state.snapshot()["ranks"]
    assert (r0["worker_pid"], r0["worker_executor"], r0["pid"]) == (200, "ray", 100)
    assert (r0["workspace_bytes"], r0["workspace_locked"], r0["captures_total"], r0["last_warmup_s"]) == (
        4096,
        True,
        1,
        0.5,
    )
    assert r0["capture_times_s"] == {"1": 0.01} and r0["last_capture_s"] == 0.02 and 0 <= r0["worker_age_s"] < 2
    assert (r1["worker_pid"], r1["workspace_bytes"], r1["worker_age_s"]) == (0, 0, None)  # not its worker
    assert r1["workspace_note"] == "no report from this rank's worker yet"
    from eepctl.render import status_text

    text = status_text(state.snapshot(), width=240)
    assert (
        "rank 0 worker: ray pid 200" in text
        and "workspace 4.0 KiB locked" in text
        and "last 500 ms" in text
        and "capture passes 1" in text
        and "[1: 10 ms]" in text
        and "rank 1 worker: no report yet" in text
    ), text
    state.report_worker(_worker(1, t0 + 1, state="warming"))  # inside a step: the worker's state shows
    assert state.snapshot()["ranks"][1]["state"] == "warming"
    refused = state.report_worker(_worker(1, t0 + 1, graphs=3))  # a field the record does not declare
    assert refused == {"accepted": False, "reason": "worker status: Object contains unknown field `graphs`"}
    state.forget_rank(1)
    assert 1 not in state.workers and [r["rank"] for r in state.snapshot()["ranks"]] == [0]


def test_executor_name_says_what_started_the_worker() -> None:
    class RayLike:
        uses_ray = True

    for backend, name in (("uni", "uni"), ("mp", "mp"), ("ray", "ray"), (RayLike, "ray"), (None, "")):
        assert (
            executor_name(SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend)))
            == name
        )


def test_a_vllm_operation_shows_its_ranks_events_while_it_ran() -> None:
    """vLLM's ranks time a scale under the id they derive (``vllm-dp<size>-<port>``), the controller
    records it as ``op-...`` with those ids as ``rank_ops``: `eepctl events --op op-... [--timeline]`
    shows the ranks' phases of that operation, not an earlier one that used the same id."""
    from eepctl.timeline import timeline

    state = RegistryState("v", kind="vllm")
    t0 = time.time()

    def ev(rank: int, phase: str, start: float, end: float, op: str = "vllm-dp3-4242") -> dict[str, Any]:
        return {"op_id": op, "rank": rank, "phase": phase, "start": start, "end": end}

    for e in (
        ev(2, "launch", t0 - 100, t0 - 60),  # a prepare held before the operation started
        ev(-1, "api_prepare", t0 + 0.1, t0 + 1),
        ev(0, "prepare", t0 + 0.2, t0 + 0.9),
        ev(0, "commit", t0 + 1, t0 + 3),
        ev(2, "commit", t0 + 1, t0 + 3),
        ev(-1, "api_commit", t0 + 1, t0 + 3.1),
    ):
        state.report_event(e)
    state.record_operation(
        {
            "op_id": "op-20261207-000000-abcd",
            "deployment": "v",
            "from_size": 2,
            "to_size": 3,
            "state": "succeeded",
            "started": t0,
            "finished": t0 + 3.5,
            "rank_ops": ["vllm-dp3-4242"],
        }
    )
    data = {
        "events": state.events_for("op-20261207-000000-abcd"),
        "operations": state.operations("op-20261207-000000-abcd"),
    }
    assert sorted((e["rank"], e["phase"]) for e in data["events"]) == [
        (-1, "api_commit"),
        (-1, "api_prepare"),
        (0, "commit"),
        (0, "prepare"),
        (2, "commit"),
    ]
    tl = timeline(data, "op-20261207-000000-abcd")
    assert {s["rank"] for s in tl["spans"]} == {-1, 0, 2} and tl["duration_s"] == 3.0
    assert len(state.events_for("vllm-dp3-4242")) == 6  # the ranks' own id: everything under it


def test_a_held_ranks_memory_counts_in_status_with_its_workers_and_kv_cache() -> None:
    """The engine core's and its worker's resident sets (the worker's only where it is a process of its
    own), the KV cache, per rank and for the standby ranks of a prepare the API server holds open."""
    gib, mib = 1 << 30, 1 << 20
    state = RegistryState("v", kind="vllm")
    state.set_info({"standby": {"state": "prepared", "prepared": 3}})
    t0 = time.time()
    state.report_status(_core(0, t0, rss_bytes=2 * gib, memory_bytes=2 * gib, kv_cache_bytes=512 * mib))
    state.report_status(_core(1, t0, rss_bytes=300 * mib, memory_bytes=300 * mib))
    state.report_status(_core(2, t0, state="standby", rss_bytes=300 * mib, memory_bytes=300 * mib, kv_cache_bytes=gib))
    state.report_worker(_worker(0, t0 + 1, executor="uni", pid=100, rss_bytes=2 * gib))  # the engine core's process
    state.report_worker(_worker(2, t0 + 1, rss_bytes=1600 * mib))  # a Ray worker: a process of its own
    snap = state.snapshot()
    r0, r1, r2 = snap["ranks"]
    assert (r0["memory_bytes"], r0["worker_rss_bytes"]) == (2 * gib, 2 * gib)  # one process, counted once
    assert (r1["memory_bytes"], r1["worker_rss_bytes"]) == (300 * mib, None)  # no worker record yet
    assert (r2["memory_bytes"], r2["worker_rss_bytes"], r2["kv_cache_bytes"]) == (1900 * mib, 1600 * mib, gib)
    s = snap["summary"]
    assert (s["memory_bytes"], s["standby_memory_bytes"], s["standby_kv_cache_bytes"]) == (
        2 * gib + 2200 * mib,
        1900 * mib,
        gib,
    )
    from eepctl.render import status_text, to_json

    text = status_text(snap, width=240)
    line = "standby: 1 engine core(s) prepared ahead (vLLM's prepare held open; a scale to DP 3 is its commit)"
    assert f"{line}; they hold 1.9 GiB (KV cache 1.0 GiB)" in text, text
    assert "; memory held 4.1 GiB" in text and "rank 2 worker: ray pid 202 (" in text and ", resident 1.6 GiB;" in text
    row = next(ln for ln in text.splitlines() if "i_dp2" in ln)
    assert [c.strip() for c in row.split("│")][4:9] == ["standby", "0/0", "0/0", "0/0", "1.9 GiB"], row
    assert [c.strip() for c in next(ln for ln in text.splitlines() if "i_dp1" in ln).split("│")][8] == "300.0 MiB"
    data = json.loads(to_json("status", snap))
    assert data["ranks"][2]["memory_bytes"] == 1900 * mib and data["summary"]["standby_kv_cache_bytes"] == gib
    state.report_status(_core(3, t0))  # a rank that reports no memory (an older plugin): a dash, not 0
    row = next(ln for ln in status_text(state.snapshot(), width=240).splitlines() if "i_dp3" in ln)
    assert [c.strip() for c in row.split("│")][8] == "–", row


def test_the_process_memory_and_kv_cache_bytes_a_rank_reports(tmp_path: Any) -> None:
    from engine_ext.rank.status_fields import process_rss_bytes
    from engine_ext.vllm.reporter import kv_cache_bytes

    assert process_rss_bytes() > 10 << 20  # this interpreter, read from /proc/self/status
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  9000 kB\nVmRSS:\t  2048 kB\nThreads:\t4\n")
    assert process_rss_bytes(status) == 2 << 20
    assert process_rss_bytes(tmp_path / "absent") is None
    tensor = SimpleNamespace  # vLLM's KVCacheTensor: every one places its layers in one backing allocation
    cfg = SimpleNamespace(kv_cache_tensors=[tensor(size=3 << 20, layers=["a"]), tensor(size=3 << 20, layers=["b"])])
    assert kv_cache_bytes(cfg) == 3 << 20 and kv_cache_bytes(None) is None
    assert kv_cache_bytes(SimpleNamespace(kv_cache_tensors=[])) is None
