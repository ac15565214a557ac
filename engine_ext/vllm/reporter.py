"""Daemon threads that carry a vLLM process's picture to the deployment's registry.

Everything here runs off vLLM's hot paths: one thread per process wakes a few times a second,
reads what vLLM already exposes (the scheduler's request counts and KV usage, the live
parallel config, the worker's telemetry) and sends it fire-and-forget to the registry actor
through a RegistryLink (engine_ext.vllm.registry_link). Ray is imported and connected only in
these threads, and only after vLLM has started its own child processes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from engine_ext.rank.status_fields import process_rss_bytes
from engine_ext.records import RankState, VllmRankStatus, to_builtins
from engine_ext.vllm.deployment_info import deployment_info
from engine_ext.vllm.registry_link import KIND, RegistryLink, Settings, node_name

log = logging.getLogger("vllm.engine_ext")


def identity(vllm_config: Any) -> tuple[str, str]:
    """(instance_id, engine_id) of a DP rank exactly as vLLM holds them in the engine core's config:
    ``vllm_config.instance_id`` and the KV-transfer ``engine_id`` ("" without a KV connector).
    vLLM suffixes both with ``_dp<rank>`` when it starts sibling DP engines
    (``_apply_dp_identity_suffix``); a missing or doubled suffix then shows up as an I1 violation."""
    instance_id = str(getattr(vllm_config, "instance_id", "") or "")
    kv = getattr(vllm_config, "kv_transfer_config", None)
    engine_id = str(getattr(kv, "engine_id", "") or "") if kv is not None else ""
    return instance_id, engine_id


class EngineCoreReporter(threading.Thread):
    """One per engine-core process (one per DP rank): the rank's RankStatus as the engine core sees
    it. Its worker reports its own part (engine_ext.vllm.worker_reporter); the registry merges them."""

    def __init__(
        self,
        settings: Settings,
        core_ref: Any,
        vllm_config: Any,
        started: float,
        interval_s: float = 1.0,
        phases: Any = None,
    ) -> None:
        super().__init__(name="eepctl-vllm-reporter", daemon=True)
        self.phases = phases  # the engine core's timed phases (engine_ext.vllm.phase_hooks.PhaseSink)
        self.settings = settings
        self.core_ref = core_ref
        self.vllm_config = vllm_config
        self.interval_s = interval_s
        self.link = RegistryLink(settings)
        self.started_at = started
        self.node = node_name()

    def _core(self) -> Any:
        return self.core_ref() if self.core_ref is not None else None

    def run(self) -> None:
        try:
            # The scheduler exists once the executor and its workers are up: connecting to Ray
            # only then keeps Ray's threads out of any process vLLM forks.
            while (core := self._core()) is not None and getattr(core, "scheduler", None) is None:
                time.sleep(0.2)
            del core
            while self._core() is not None and not self.link.disabled:
                self.link.report_status(self.build_status())
                if self.phases is not None:
                    self.link.report_events(self.phases.drain_events())
                time.sleep(self.interval_s)
        except Exception as e:  # noqa: BLE001 - never take the engine down
            log.warning("engine_ext: reporter stopped: %s: %s", type(e).__name__, e)

    def build_status(self) -> dict[str, Any]:
        core = self._core()
        pc = self.vllm_config.parallel_config
        rank = int(getattr(pc, "data_parallel_rank", 0) or 0)  # read live (I6)
        dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
        instance_id, engine_id = identity(self.vllm_config)
        scheduler = getattr(core, "scheduler", None)
        running = waiting = blocks_total = 0
        kv_cfg = None
        usage = 0.0
        if scheduler is not None:
            try:
                running, waiting = scheduler.get_request_counts()
            except Exception:  # noqa: BLE001
                pass
            try:
                usage = float(scheduler.get_kv_cache_usage())
            except Exception:  # noqa: BLE001
                pass
            kv_cfg = getattr(scheduler, "kv_cache_config", None)
            blocks_total = int(getattr(kv_cfg, "num_blocks", 0) or 0)
        rss = process_rss_bytes()
        sched_cfg = getattr(self.vllm_config, "scheduler_config", None)
        state = RankState.SERVING.value if scheduler is not None else RankState.STARTING.value
        if scheduler is not None and _prepared_ahead(core):
            state = RankState.STANDBY.value  # a new rank of a prepared scale: not serving until its commit
        return to_builtins(
            VllmRankStatus(
                deployment=self.settings.deployment,
                rank=rank,
                instance_id=instance_id,
                engine_id=engine_id,
                kind=KIND,
                node=self.node,
                pid=os.getpid(),
                device=_platform_device(),
                state=state,
                dp_size=dp_size,
                requests_running=int(running),
                requests_waiting=int(waiting),
                slots_used=int(running),
                slots_total=int(getattr(sched_cfg, "max_num_seqs", 0) or 0),
                kv_blocks_used=int(round(usage * blocks_total)),
                kv_blocks_total=blocks_total,
                graph_kind="none",
                last_heartbeat=time.time(),
                kv_usage=round(usage, 6),
                workspace_note="no report from this rank's worker yet",
                dp_backend=str(getattr(pc, "data_parallel_backend", "") or ""),
                elastic_ep=bool(getattr(pc, "enable_elastic_ep", False)),
                started=self.started_at,
                rss_bytes=rss,
                memory_bytes=rss,  # the worker's is added where it is another process (worker_records.merge)
                kv_cache_bytes=kv_cache_bytes(kv_cfg),
            )
        )


def kv_cache_bytes(kv_cfg: Any) -> int | None:
    """The KV cache one worker of the rank allocates, from the scheduler's ``kv_cache_config``: every
    ``KVCacheTensor`` places its layers in one backing allocation of ``size`` bytes (vLLM's
    ``vllm.v1.worker.utils`` allocates it once). None before the KV cache exists."""
    sizes = [int(getattr(t, "size", 0) or 0) for t in getattr(kv_cfg, "kv_cache_tensors", None) or []]
    return max(sizes) if sizes else None


def _prepared_ahead(core: Any) -> bool:
    """A new rank of a prepare the plugin holds open (``EEPCTL_VLLM_STANDBY``), not yet committed."""
    from engine_ext.vllm.standby import enabled, held_rank

    try:
        return enabled() and held_rank(core)
    except Exception:  # noqa: BLE001
        return False


def _platform_device() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type or "cpu")
    except Exception:  # noqa: BLE001
        return "unknown"


class ApiServerReporter(threading.Thread):
    """The API-server process: keeps the deployment's info (kind, URL, DP bounds) in the registry."""

    def __init__(
        self,
        settings: Settings,
        vllm_config: Any,
        api_url: str,
        api_key_required: bool,
        interval_s: float = 2.0,
        watch: Any = None,
        phases: Any = None,
        standby: Any = None,
    ) -> None:
        super().__init__(name="eepctl-vllm-api-reporter", daemon=True)
        self.standby = standby  # engine_ext.vllm.standby.HeldPrepare, with EEPCTL_VLLM_STANDBY=N
        self.phases = phases  # the API server's timed phases of a scale (engine_ext.vllm.phase_hooks.PhaseSink)
        self.link = RegistryLink(settings)
        self.vllm_config = vllm_config
        self.api_url = api_url
        self.api_key_required = api_key_required
        self.interval_s = interval_s
        self.watch = watch

    def run(self) -> None:
        started_for = 0  # the link's connect its controller was started for
        try:
            while not self.link.disabled:
                # Rebuilt each time: the DP size lives in the config vLLM updates after a scale.
                info = deployment_info(self.vllm_config, self.api_url, self.api_key_required, self.watch)
                if self.standby is not None:
                    info["standby"] = self.standby.report(self.link)  # and the count eepctl asked, applied
                self.link.set_info(info)
                if self.phases is not None:
                    self.link.report_events(self.phases.drain_events())
                if self.link.connect() and started_for != self.link.connects:
                    # Again for a registry made anew: `eepctl down` removed the controller with it,
                    # and the server it watches (crashes, orphaned scales, autoscaling) serves on.
                    self._start_controller()
                    started_for = self.link.connects
                time.sleep(self.interval_s)
        except Exception as e:  # noqa: BLE001
            log.warning("engine_ext: API reporter stopped: %s: %s", type(e).__name__, e)

    def _start_controller(self) -> None:
        """The deployment's vLLM controller (engine_ext.ray.vllm_controller), so its loop watches
        vLLM's flag from the start, not only once eepctl first scaled. Best effort: eepctl
        creates it on its first scale or autoscale otherwise."""
        try:
            from engine_ext.ray.vllm_controller import controller_for

            controller_for(self.link.settings.deployment, self.link.settings.namespace)
        except Exception as e:  # noqa: BLE001 - serving never depends on it
            log.warning(
                "engine_ext: vLLM controller not started (%s: %s); eepctl starts it when asked",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            # not retried every 2 s: once per registry reached
