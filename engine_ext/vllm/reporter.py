"""Daemon threads that carry a vLLM process's picture to the deployment's registry.

Everything here runs off vLLM's hot paths: one thread per process wakes a few times a second,
reads what vLLM already exposes (the scheduler's request counts and KV usage, the live
parallel config, the worker's telemetry) and sends it fire-and-forget to the registry actor.
Ray is imported and connected only in these threads, and only after vLLM has started its
own child processes.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from engine_ext.records import DeploymentKind, RankState, VllmRankStatus, to_builtins

log = logging.getLogger("vllm.engine_ext")

KIND = DeploymentKind.VLLM.value


@dataclass(frozen=True)
class Settings:
    deployment: str
    namespace: str
    address: str


class RegistryLink:
    """Fire-and-forget calls to ``eep-registry.<deployment>``; created (kind "vllm") if missing.

    A lost registry is recreated on the next call and given the recent events again (it drops
    duplicates), so it rebuilds the picture from the ranks as the reference registry does.
    """

    def __init__(self, settings: Settings, resend: int = 500) -> None:
        self.settings = settings
        self._handle: Any = None
        self._pending: Any = None
        self._recent: deque[dict[str, Any]] = deque(maxlen=resend)
        self.disabled = ""
        self._warned: set[str] = set()

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def connect(self) -> bool:
        if self.disabled:
            return False
        if self._handle is not None:
            return True
        try:
            import ray
            from engine_ext.ray.names import registry_name
            from engine_ext.ray.registry import Registry

            if not ray.is_initialized():
                ray.init(address=self.settings.address, logging_level=logging.ERROR, log_to_driver=False)
            name = registry_name(self.settings.deployment)
            handle = (
                ray.remote(Registry)
                .options(
                    name=name, namespace=self.settings.namespace, lifetime="detached", num_cpus=0, get_if_exists=True
                )
                .remote(self.settings.deployment, KIND)
            )
            kind = ray.get(handle.snapshot.remote(), timeout=30).get("kind")
            if kind != KIND:
                self.disabled = f"registry {name} belongs to a {kind!r} deployment"
                log.warning("engine_ext: %s; this vLLM process does not report to it", self.disabled)
                return False
            self._handle = handle
            if self._recent:
                handle.report_events.remote(list(self._recent))
            log.info("engine_ext: reporting to %s in namespace %s", name, self.settings.namespace)
            return True
        except Exception as e:  # noqa: BLE001 - the registry is optional for serving
            self._warn_once(
                "connect",
                "engine_ext: registry of %s not reachable yet (%s: %s); retrying",
                self.settings.deployment,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            self._handle = None
            return False

    def _call(self, method: str, *args: Any) -> Any:
        if not self.connect():
            return None
        try:
            return getattr(self._handle, method).remote(*args)
        except Exception as e:  # noqa: BLE001
            log.debug("engine_ext: %s failed (%s); reconnecting", method, e)
            self._handle = None
            return None

    def report_status(self, status: dict[str, Any]) -> None:
        self._check_pending()
        self._pending = self._call("report_status", status)

    def report_worker(self, record: dict[str, Any]) -> None:
        self._check_pending()  # a dead registry is noticed here, as for report_status
        self._pending = self._call("report_worker", record)

    def report_events(self, events: list[dict[str, Any]]) -> None:
        if events:
            self._recent.extend(events)
            self._call("report_events", events)

    def set_info(self, info: dict[str, Any]) -> None:
        self._call("set_info", info)

    def _check_pending(self) -> None:
        """Look at the previous status report's answer without waiting for it."""
        ref, self._pending = self._pending, None
        if ref is None:
            return
        try:
            import ray

            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                return
            answer = ray.get(ready[0], timeout=1)
            if isinstance(answer, dict) and not answer.get("accepted", True):
                self._warn_once("dup", "engine_ext: registry refused this rank: %s", answer.get("reason"))
        except Exception as e:  # noqa: BLE001 - the actor died: recreate it on the next call
            log.debug("engine_ext: registry call failed (%s); reconnecting", e)
            self._handle = None


def node_name() -> str:
    host = socket.gethostname()
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        ip = ""
    return f"{host}/{ip}" if ip else host


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
            )
        )


def _prepared_ahead(core: Any) -> bool:
    """A new rank of a prepare the plugin holds open (``EEPCTL_VLLM_STANDBY``), not yet committed."""
    from engine_ext.vllm.standby import held_rank, requested

    try:
        return bool(requested()) and held_rank(core)
    except Exception:  # noqa: BLE001
        return False


def _platform_device() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type or "cpu")
    except Exception:  # noqa: BLE001
        return "unknown"


def public_url(listen_address: str) -> str:
    """The API server's URL as another host reaches it (a wildcard bind becomes this node's IP)."""
    override = os.environ.get("EEPCTL_VLLM_API_URL")
    if override:
        return override
    parts = urlsplit(listen_address)
    host = parts.hostname or ""
    if host in ("", "0.0.0.0", "::"):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit((parts.scheme, netloc, "", "", ""))
    return urlunsplit((parts.scheme, parts.netloc, "", "", ""))


def deployment_info(vllm_config: Any, api_url: str, api_key_required: bool, watch: Any = None) -> dict[str, Any]:
    """What eepctl needs about a vLLM deployment. Never the API key: only whether one is set."""
    pc = getattr(vllm_config, "parallel_config", None)
    mc = getattr(vllm_config, "model_config", None)
    info: dict[str, Any] = {
        "kind": KIND,
        "api_url": api_url,
        "api_pid": os.getpid(),
        "api_node": node_name(),
        "api_heartbeat": time.time(),
        # vLLM's base identity; it gives DP rank r of a DP > 1 deployment "<base>_dp<r>"
        "instance_id": str(getattr(vllm_config, "instance_id", "") or ""),
    }
    if pc is not None:
        dp = int(getattr(pc, "data_parallel_size", 1) or 1)
        info.update(
            {
                "dp": dp,
                "max_dp": int(getattr(pc, "elastic_ep_max_dp_size", None) or dp),
                "elastic_ep": bool(getattr(pc, "enable_elastic_ep", False)),
                "dp_backend": str(getattr(pc, "data_parallel_backend", "") or ""),
                "expert_parallel": bool(getattr(pc, "enable_expert_parallel", False)),
                "eplb": bool(getattr(pc, "enable_eplb", False)),
                "fault_tolerance": bool(getattr(pc, "enable_fault_tolerance", False)),
            }
        )
        try:
            experts = int(mc.get_num_experts()) if mc is not None else 0
            redundant = int(getattr(getattr(pc, "eplb_config", None), "num_redundant_experts", 0) or 0)
            if experts:
                physical = experts + redundant
                info.update(
                    {"num_experts": experts, "num_redundant_experts": redundant, "min_dp": -(-experts * dp // physical)}
                )
        except Exception:  # noqa: BLE001
            pass
    if mc is not None:
        info["model"] = str(getattr(mc, "served_model_name", None) or getattr(mc, "model", ""))
    info["api_key_required"] = api_key_required
    info["api_command"] = restart_command()
    if watch is not None:  # the wedged state (None when healthy) and the scales this server ran
        from engine_ext.vllm import api_patches

        info.update(
            wedged=watch.wedge(),
            scaling=api_patches.scaling_flag(),
            scale_calls=watch.calls,
            api_patches=api_patches.status(),
        )
    try:
        import vllm

        info["vllm_version"] = str(vllm.__version__)
    except Exception:  # noqa: BLE001
        pass
    return info


@functools.lru_cache(maxsize=1)
def _own_cmdline() -> list[str]:
    """This process's command line as it was started (read once: the info is refreshed every 2 s)."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return [sys.executable, *sys.argv]


def restart_command(cmdline: list[str] | None = None) -> str:
    """The API server's own command line, for the operator to run again after vLLM exited (a dead
    engine core takes the whole server down), with any API key replaced by ``$VLLM_API_KEY``."""
    import shlex

    if cmdline is None:
        cmdline = _own_cmdline()
    out: list[str] = []
    hide = False
    for arg in cmdline:
        if hide:
            out.append("$VLLM_API_KEY")
        elif arg.startswith("--api-key="):
            out.append("--api-key=$VLLM_API_KEY")
        else:
            out.append(shlex.quote(arg))
        hide = arg == "--api-key"
    return " ".join(out)


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
        controller = False
        try:
            while not self.link.disabled:
                # Rebuilt each time: the DP size lives in the config vLLM updates after a scale.
                info = deployment_info(self.vllm_config, self.api_url, self.api_key_required, self.watch)
                if self.standby is not None:
                    info["standby"] = dict(self.standby.state, prepared=self.standby.prepared())
                self.link.set_info(info)
                if self.phases is not None:
                    self.link.report_events(self.phases.drain_events())
                if not controller and self.link.connect():
                    controller = self._start_controller()
                time.sleep(self.interval_s)
        except Exception as e:  # noqa: BLE001
            log.warning("engine_ext: API reporter stopped: %s: %s", type(e).__name__, e)

    def _start_controller(self) -> bool:
        """The deployment's vLLM controller (engine_ext.ray.vllm_controller), so its loop watches
        vLLM's flag from the start, not only once eepctl first scaled. Best effort: eepctl
        creates it on its first scale or autoscale otherwise."""
        try:
            from engine_ext.ray.vllm_controller import controller_for

            controller_for(self.link.settings.deployment, self.link.settings.namespace)
            return True
        except Exception as e:  # noqa: BLE001 - serving never depends on it
            log.warning(
                "engine_ext: vLLM controller not started (%s: %s); eepctl starts it when asked",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            return True  # not retried every 2 s
