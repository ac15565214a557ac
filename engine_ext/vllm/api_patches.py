"""What the plugin changes and watches in vLLM's API-server process.

* ``guard_endpoints``: vLLM's ``--api-key`` middleware guards only paths under ``/v1``, ``/v2``,
  ``/inference`` and ``/cohere``; the elastic-EP endpoints, the dev-mode ``/collective_rpc`` and
  the fault-tolerance endpoints stay open (vLLM #55536): anyone who reaches the port can start a
  scale, and every client then gets 503. The middleware reads its module global
  ``GUARDED_PREFIX`` on each request, so extending that tuple is the whole patch.
* ``ScaleWatch``: wraps ``AsyncLLM._scale_elastic_ep`` to know whether a transition is in flight
  and how the last one ended. vLLM sets its scaling flag before the commit and clears it only
  when the commit returns; a commit that raises leaves it set, and every request gets 503 until
  a restart (#50778, #53947). The watch names that state ("wedged") for the registry.
* ``arm_commit_fault``: a test hook, active only with ``EEPCTL_VLLM_DEBUG_FAIL_COMMIT=<file>``:
  while that file exists, the engine client's prepare is skipped and its commit raises, so vLLM's
  own ``_scale_elastic_ep`` leaves its flag set exactly as a failed commit does.

Nothing happens at import; every function is re-entrant and never raises into vLLM.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
from typing import Any

from engine_ext.faults import DEBUG_FAIL_COMMIT_ENV, debug_fail_commit_file

log = logging.getLogger("vllm.engine_ext")

AUTH_MODULE = "vllm.entrypoints.serve.middleware.authenticate"
SCALING_MODULE = "vllm.entrypoints.serve.elastic_ep.middleware"
# Paths vLLM 0.32 serves without its API-key check (#55536); guarded by prefix, as vLLM does.
UNGUARDED_PATHS = ("/scale_elastic_ep", "/is_scaling_elastic_ep", "/collective_rpc", "/fault_tolerance/")
REMEDY = (
    "restart the vLLM API server (stop it and start it again with the same arguments); vLLM keeps "
    "answering 503 until then (vLLM #50778, #53947). Then `eepctl status` shows the ranks again"
)

# name -> "active" or "unavailable: <why>", for the deployment info.
_status: dict[str, str] = {}
_lock = threading.Lock()


def status() -> dict[str, str]:
    with _lock:
        return dict(_status)


def mark(name: str, why: str) -> None:
    """Record what became of ``name`` ("active" or "unavailable: <why>") for the deployment info."""
    with _lock:
        _status[name] = why


def guard_endpoints() -> str:
    """Make vLLM's API-key middleware cover ``UNGUARDED_PATHS``; "active" or why not."""
    with _lock:
        _status["guard_endpoints"] = why = _guard()
    if why != "active":
        log.warning("engine_ext: %s stay open without the API key (%s)", ", ".join(UNGUARDED_PATHS), why)
    return why


def _guard() -> str:
    import importlib

    try:
        auth = importlib.import_module(AUTH_MODULE)
    except Exception as e:  # noqa: BLE001
        return f"unavailable: {AUTH_MODULE} cannot be imported ({type(e).__name__})"
    prefix = getattr(auth, "GUARDED_PREFIX", None)
    middleware = getattr(auth, "AuthenticationMiddleware", None)
    call = middleware.__call__ if callable(middleware) else None
    if not (isinstance(prefix, tuple) and all(isinstance(p, str) for p in prefix)):
        return f"unavailable: {AUTH_MODULE}.GUARDED_PREFIX is not a tuple of paths"
    if call is None or "GUARDED_PREFIX" not in getattr(getattr(call, "__code__", None), "co_names", ()):
        return "unavailable: AuthenticationMiddleware.__call__ no longer reads GUARDED_PREFIX"
    missing = tuple(p for p in UNGUARDED_PATHS if not p.startswith(prefix))
    if missing:
        auth.GUARDED_PREFIX = prefix + missing
    return "active"


class ScaleWatch:
    """Whether a vLLM transition is in flight in this API server, and how the last one ended."""

    def __init__(self, wedged_after_s: float = 5.0) -> None:
        self.wedged_after_s = wedged_after_s
        self._lock = threading.Lock()
        self.in_flight = 0
        self.calls = 0
        self.last_failure: dict[str, Any] | None = None
        self._flag_since: float | None = None
        # awaited inside vLLM's scale, before it (engine_ext.vllm.standby drops a prepare held for another size)
        self.before: Any = None

    def install(self) -> str:
        """Wrap ``AsyncLLM._scale_elastic_ep`` (idempotent); "active" or why not."""
        try:
            from vllm.v1.engine.async_llm import AsyncLLM
        except Exception as e:  # noqa: BLE001
            why = f"unavailable: AsyncLLM cannot be imported ({type(e).__name__})"
        else:
            why = self._wrap(AsyncLLM)
        with _lock:
            _status["scale_watch"] = why
        return why

    def _wrap(self, owner: type) -> str:
        current = owner.__dict__.get("_scale_elastic_ep")
        if current is None:
            return "unavailable: AsyncLLM defines no _scale_elastic_ep"
        if getattr(current, "__eepctl_patch__", None) == "scale_watch":
            return "active"
        params = tuple(inspect.signature(current).parameters)
        if params != ("self", "new_data_parallel_size", "drain_timeout") or not inspect.iscoroutinefunction(current):
            return f"unavailable: AsyncLLM._scale_elastic_ep takes ({', '.join(params)})"
        watch = self

        @functools.wraps(current)
        async def _scale_elastic_ep(self: Any, new_data_parallel_size: int, drain_timeout: int) -> Any:
            watch._begin()
            try:
                if watch.before is not None:
                    await watch.before(new_data_parallel_size)
                result = await current(self, new_data_parallel_size, drain_timeout)
            except BaseException as e:
                watch._failed(new_data_parallel_size, e)
                raise
            finally:
                watch._end()
            watch.last_failure = None
            return result

        _scale_elastic_ep.__eepctl_patch__ = "scale_watch"  # type: ignore[attr-defined]
        owner._scale_elastic_ep = _scale_elastic_ep  # type: ignore[attr-defined]
        return "active"

    def _begin(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.calls += 1

    def _end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _failed(self, target: int, error: BaseException) -> None:
        # vLLM raises its flag after prepare and lowers it itself when the drain fails: a failure
        # with the flag still up is a failed commit.
        phase = "commit" if scaling_flag() else "prepare/drain"
        with self._lock:
            self.last_failure = {
                "at": time.time(),
                "phase": phase,
                "to_size": int(target),
                "error": f"{type(error).__name__}: {error}"[:300],
            }

    def wedge(self, now: float | None = None) -> dict[str, Any] | None:
        """The wedged state, or None: vLLM's flag up and no transition in flight, either right
        after a transition failed with it up, or for longer than ``wedged_after_s``."""
        now = time.time() if now is None else now
        flag = scaling_flag()
        with self._lock:
            if not flag:
                self._flag_since = None
                return None
            since = self._flag_since = self._flag_since or now
            if self.in_flight:
                return None
            failure = self.last_failure
            if failure is not None and failure["phase"] == "commit":
                return {
                    "since": failure["at"],
                    "phase": failure["phase"],
                    "to_size": failure["to_size"],
                    "error": failure["error"],
                    "cause": "a scale failed after vLLM raised its scaling flag",
                    "remedy": REMEDY,
                }
            if now - since < self.wedged_after_s:
                return None
            return {
                "since": since,
                "phase": "unknown",
                "to_size": None,
                "error": "",
                "cause": f"vLLM's scaling flag has been set for over {self.wedged_after_s:.0f}s with no "
                "scale in flight in this API server",
                "remedy": REMEDY,
            }


def scaling_flag() -> bool:
    """vLLM's own scaling flag (the one its middleware answers 503 on); False if unreadable."""
    try:
        from vllm.entrypoints.serve.elastic_ep.middleware import get_scaling_elastic_ep

        return bool(get_scaling_elastic_ep())
    except Exception:  # noqa: BLE001
        return False


def arm_commit_fault(engine_client: Any) -> bool:
    """Test hook (only with ``EEPCTL_VLLM_DEBUG_FAIL_COMMIT=<file>``): while the file exists, the
    engine client's ``prepare_elastic_ep`` does nothing and its ``commit_elastic_ep`` raises, on
    this one client object. Otherwise both are vLLM's. True when the hook was installed."""
    trigger = debug_fail_commit_file()
    core = getattr(engine_client, "engine_core", None)
    if not trigger or core is None or getattr(core, "__eepctl_fault__", False):
        return False
    prepare, commit = core.prepare_elastic_ep, core.commit_elastic_ep

    async def prepare_elastic_ep(new_data_parallel_size: int) -> None:
        if not os.path.exists(trigger):
            await prepare(new_data_parallel_size)

    async def commit_elastic_ep() -> None:
        if os.path.exists(trigger):
            raise RuntimeError(f"commit failure injected by {DEBUG_FAIL_COMMIT_ENV}")
        await commit()

    core.prepare_elastic_ep, core.commit_elastic_ep = prepare_elastic_ep, commit_elastic_ep
    core.__eepctl_fault__ = True
    log.warning("engine_ext: %s is set: scale commits fail while %s exists (test hook)", DEBUG_FAIL_COMMIT_ENV, trigger)
    return True
