"""The vLLM symbols the plugin wraps, found by name and checked before they are touched.

Each entry of ``CATALOGUE`` names one method of the installed vLLM (module, class, attribute),
the parameters we expect it to take, and what its wrapper records. ``apply`` wraps every
entry whose symbol exists with the expected signature; one that is missing or changed is
logged once and reported as unavailable, and vLLM keeps its own method. A wrapper only times
the call and records it (``VllmTelemetry.enter`` / ``exit`` never raise): the vLLM method runs
unchanged, and its result or exception goes back to its caller untouched. The catalogue with
the reasons and the related upstream PRs is in docs/vllm-plugin.md.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm.engine_ext")

# The vLLM release the catalogue was checked against; another release is still patched where
# every signature matches, and says so once.
TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")

_ELASTIC = "vllm.distributed.elastic_ep.elastic_execute"
_EXECUTOR = "ElasticEPScalingExecutor"
_RUNNER = "vllm.v1.worker.gpu_model_runner"

AVAILABLE = "active"


@dataclass(frozen=True)
class PatchSpec:
    """One wrapped vLLM method."""

    module: str
    owner: str
    attr: str
    params: tuple[str, ...]  # expected parameter names, ``self`` first
    phase: str  # the Event phase its calls are recorded as
    state: str | None = None  # the rank state while it runs (None: unchanged)
    # "elastic": a step of a transition; "warmup": the worker's warm-up (which captures on GPUs);
    # "capture": one capture pass of the model runner; "capture_size": one size inside a pass
    role: str = "elastic"
    ends_op: bool = False  # the outermost call closes the worker's current operation
    sized: bool = False  # a capture pass counts only when it captured at least one size
    name: str = ""  # the key, where two owners share a class name
    # "method"; "static" (a staticmethod: no self); "function" (a module function, ``owner`` "",
    # replaced in the module ``seen_in`` whose global its callers read, defined in ``module``)
    kind: str = "method"
    seen_in: str = ""

    @property
    def qualname(self) -> str:
        return f"{self.owner}.{self.attr}" if self.owner else self.attr

    @property
    def key(self) -> str:
        return self.name or self.qualname

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.qualname}"


CATALOGUE: tuple[PatchSpec, ...] = (
    PatchSpec(
        _ELASTIC,
        _EXECUTOR,
        "prepare_reconfiguration",
        ("self", "reconfig_request", "use_all2all"),
        "prepare",
        state="preparing",
    ),
    PatchSpec(_ELASTIC, _EXECUTOR, "_prepare_eplb_communicator", ("self", "eplb_group"), "eplb_communicator"),
    PatchSpec(_ELASTIC, _EXECUTOR, "transfer_weights", ("self", "old_dp_size", "new_dp_size"), "transfer"),
    PatchSpec(_ELASTIC, _EXECUTOR, "prepare_new_worker", ("self",), "transfer", state="preparing"),
    PatchSpec(_ELASTIC, _EXECUTOR, "switch_and_prepare", ("self",), "switch", state="committing"),
    PatchSpec(_ELASTIC, _EXECUTOR, "_release_cuda_graphs", ("self",), "release_graphs"),
    PatchSpec(_ELASTIC, _EXECUTOR, "_perform_eplb_reshuffle", ("self", "rank_mapping", "async_op"), "reshuffle"),
    PatchSpec(_ELASTIC, _EXECUTOR, "warm_and_capture", ("self",), "warm", state="warming"),
    PatchSpec(
        _ELASTIC,
        _EXECUTOR,
        "commit_scale_up",
        ("self", "is_existing_worker"),
        "commit",
        state="committing",
        ends_op=True,
    ),
    PatchSpec(
        _ELASTIC,
        _EXECUTOR,
        "commit_scale_down",
        ("self", "new_dp_size", "removing"),
        "commit",
        state="committing",
        ends_op=True,
    ),
    PatchSpec(_ELASTIC, _EXECUTOR, "switch_and_remove", ("self",), "remove", state="removing", ends_op=True),
    PatchSpec(
        "vllm.v1.worker.gpu_worker",
        "Worker",
        "compile_or_warm_up_model",
        ("self",),
        "warmup",
        state="warming",
        role="warmup",
    ),
    PatchSpec(
        "vllm.v1.worker.cpu_worker",
        "CPUWorker",
        "compile_or_warm_up_model",
        ("self",),
        "warmup",
        state="warming",
        role="warmup",
    ),
    PatchSpec(
        _RUNNER, "GPUModelRunner", "capture_model", ("self",), "capture", state="capturing", role="capture", sized=True
    ),
    PatchSpec(
        _RUNNER,
        "GPUModelRunner",
        "_warmup_and_capture",
        (
            "self",
            "desc",
            "cudagraph_runtime_mode",
            "profile_seq_lens",
            "allow_microbatching",
            "num_warmups",
            "profiler",
        ),
        "capture_size",
        role="capture_size",
    ),
    PatchSpec(
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        "capture_model",
        ("self", "profile_only"),
        "capture",
        state="capturing",
        role="capture",
        name="GPUModelRunnerV2.capture_model",
    ),
)

# The patch state of this process: key -> "active" or "unavailable: <why>".
_status: dict[str, str] = {}
_lock = threading.Lock()
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def resolve(spec: PatchSpec) -> tuple[Any, Callable[..., Any] | None, str]:
    """(the class or module that holds it, the original function, "" or why it is unavailable).
    Imports the module (and ``seen_in``)."""
    try:
        module = importlib.import_module(spec.module)
        holder = importlib.import_module(spec.seen_in) if spec.seen_in else module
    except Exception as e:  # noqa: BLE001 - any import failure means "unavailable"
        return None, None, f"module {spec.seen_in or spec.module} cannot be imported ({type(e).__name__}: {e})"
    if spec.kind == "function":
        owner: Any = holder
        if not _unwrap(vars(module).get(spec.attr)):
            return None, None, f"{spec.module} has no {spec.attr}"
    else:
        owner = getattr(module, spec.owner, None)
        if owner is None:
            return None, None, f"{spec.module} has no {spec.owner}"
    func = _unwrap(vars(owner).get(spec.attr))
    if func is None:
        return owner, None, f"{spec.owner or holder.__name__} defines no {spec.attr}"
    if spec.kind == "function" and func is not _unwrap(vars(module).get(spec.attr)):
        return owner, None, f"{holder.__name__}.{spec.attr} is not {spec.module}'s"
    if not callable(func):
        return owner, None, f"{spec.key} is not a function"
    try:
        params = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError) as e:
        return owner, None, f"signature of {spec.key} unreadable: {e}"
    if params != spec.params:
        return owner, None, f"{spec.key} takes ({', '.join(params)}), expected ({', '.join(spec.params)})"
    return owner, func, ""


def _raw(current: Any) -> Any:
    """A class or module attribute as called: a staticmethod's function."""
    return current.__func__ if isinstance(current, staticmethod) else current


def _unwrap(current: Any) -> Any:
    """vLLM's own function behind a class or module attribute (and behind our wrapper)."""
    current = _raw(current)
    return getattr(current, "__eepctl_original__", current)


class GuardedSink:
    """What a wrapper reports to: ``enter`` and ``exit`` never raise into vLLM (a sink that fails
    leaves the call untimed, logged at debug level). Subclasses implement ``_enter`` (a token, or
    None for a call not followed) and ``_exit``."""

    def enter(self, spec: PatchSpec, obj: Any, args: tuple, kwargs: dict) -> int | None:
        try:
            return self._enter(spec, obj, args, kwargs)
        except Exception as e:  # noqa: BLE001 - never break vLLM
            log.debug("engine_ext: enter %s failed: %s", getattr(spec, "key", spec), e)
            return None

    def exit(self, token: int | None, error: BaseException | None) -> None:
        if token is None:
            return
        try:
            self._exit(token, error)
        except Exception as e:  # noqa: BLE001
            log.debug("engine_ext: exit failed: %s", e)

    def _enter(self, spec: PatchSpec, obj: Any, args: tuple, kwargs: dict) -> int | None:
        raise NotImplementedError

    def _exit(self, token: int, error: BaseException | None) -> None:
        raise NotImplementedError


def make_wrapper(spec: PatchSpec, original: Callable[..., Any], sink: Any) -> Callable[..., Any]:
    """A function that records ``spec``'s calls in ``sink`` and otherwise is ``original`` (a
    coroutine function stays one). ``sink.enter`` gets the bound object (None for a static or
    module function), the other arguments and the keywords."""
    bound = spec.kind == "method"

    def split(args: tuple) -> tuple[Any, tuple]:
        return (args[0], args[1:]) if bound and args else (None, args)

    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            token = sink.enter(spec, *split(args), kwargs)
            try:
                result = await original(*args, **kwargs)
            except BaseException as e:
                sink.exit(token, e)
                raise
            sink.exit(token, None)
            return result
    else:

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            token = sink.enter(spec, *split(args), kwargs)
            try:
                result = original(*args, **kwargs)
            except BaseException as e:
                sink.exit(token, e)
                raise
            sink.exit(token, None)
            return result

    wrapper.__eepctl_patch__ = spec.key  # type: ignore[attr-defined]
    wrapper.__eepctl_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _installed(spec: PatchSpec, function: Callable[..., Any]) -> Any:
    """What goes into the class or module: a staticmethod stays one."""
    return staticmethod(function) if spec.kind == "static" else function


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001
        return "not importable"


def apply(sink: Any, specs: tuple[PatchSpec, ...] = CATALOGUE) -> dict[str, str]:
    """Wrap every spec that checks out; idempotent (a wrapped method is left as it is)."""
    with _lock:
        version = vllm_version()
        if version not in TESTED_VLLM_VERSIONS:
            _warn_once(
                "version",
                "engine_ext: vLLM %s is not a release the plugin was checked against (%s); "
                "each hook is still checked by signature",
                version,
                ", ".join(TESTED_VLLM_VERSIONS),
            )
        for spec in specs:
            owner, original, why = resolve(spec)
            if original is None:
                _status[spec.key] = f"unavailable: {why}"
                _warn_once(spec.key, "engine_ext: hook %s unavailable (%s); not reported", spec.key, why)
                continue
            if getattr(_raw(vars(owner)[spec.attr]), "__eepctl_patch__", None) == spec.key:
                _status[spec.key] = AVAILABLE
                continue
            setattr(owner, spec.attr, _installed(spec, make_wrapper(spec, original, sink)))
            _status[spec.key] = AVAILABLE
        return dict(_status)


def remove(specs: tuple[PatchSpec, ...] = CATALOGUE) -> None:
    """Put vLLM's own methods back (tests; the plugin itself never needs to)."""
    with _lock:
        for spec in specs:
            owner, original, _ = resolve(spec)
            if owner is not None and original is not None:
                if getattr(_raw(vars(owner).get(spec.attr)), "__eepctl_patch__", None) == spec.key:
                    setattr(owner, spec.attr, _installed(spec, original))
            _status.pop(spec.key, None)


def status() -> dict[str, str]:
    with _lock:
        return dict(_status)
