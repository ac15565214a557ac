"""``vllm.platform_plugins`` entry: vLLM's CPU platform, opened for expert parallelism (opt-in).

``activate()`` returns this platform's qualified name only when the operator asks for it
(``EEPCTL_VLLM_CPU_EP=1``), vLLM would pick its CPU platform anyway, and the installed vLLM is
one the CPU patches were verified against (engine_ext.vllm.cpu_patches); otherwise ``None``, and
vLLM chooses its platform as if the plugin were absent (a GPU vLLM with the plugin installed
behaves exactly as before). vLLM resolves the platform in every process it starts, so each one
decides the same way from the same environment.

``EepCpuPlatform`` differs from vLLM's ``CpuPlatform`` in its device communicator
(engine_ext.vllm.cpu_communicator: the variable-size collectives DP + EP needs), a Ray device key
for the Ray DP backend, process (``mp``) workers inside Ray engine actors, and synchronous EPLB;
engine_ext.vllm.cpu_patches holds the rest. The class is built on first access: importing this
module imports nothing of vLLM.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("vllm.engine_ext")

ENABLE_ENV = "EEPCTL_VLLM_CPU_EP"
QUALNAME = "engine_ext.vllm.cpu_platform.EepCpuPlatform"
CARRY_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
DEVICE_KEY_ENV = "EEPCTL_VLLM_RAY_DEVICE_KEY"  # the Ray resource a DP rank's worker takes one unit of
DEFAULT_DEVICE_KEY = "vllm_cpu_rank"
WORKERS_ENV = "EEPCTL_VLLM_CPU_WORKERS"  # "ray" (vLLM's choice for the Ray DP backend) or "mp"
_cls: type | None = None


def requested(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ENABLE_ENV, "") == "1"


def workers_backend(env: dict[str, str] | None = None) -> str:
    """How a Ray-DP deployment on this platform starts its workers: "ray" (vLLM's Ray workers,
    the GPU configuration; default) or "mp" (processes inside each engine actor)."""
    return "mp" if (os.environ if env is None else env).get(WORKERS_ENV, "") == "mp" else "ray"


def activate() -> str | None:
    """The platform-plugin function vLLM calls: our qualname, or None (never raises)."""
    if not requested():
        return None
    try:
        from vllm.platforms import cpu_platform_plugin

        if cpu_platform_plugin() is None:
            log.warning("engine_ext: %s=1 ignored: this vLLM does not run on its CPU platform", ENABLE_ENV)
            return None
        from engine_ext.vllm.cpu_patches import refusal

        why = refusal()
        if why:
            log.warning("engine_ext: %s=1 refused: %s", ENABLE_ENV, why)
            return None
        return QUALNAME
    except Exception as e:  # noqa: BLE001 - platform detection must not fail vLLM
        log.warning("engine_ext: %s=1 ignored: %s: %s", ENABLE_ENV, type(e).__name__, e)
        return None


def __getattr__(name: str) -> Any:
    if name == "EepCpuPlatform":
        return platform_class()
    raise AttributeError(name)


def platform_class() -> type:
    global _cls
    if _cls is None:
        _cls = _build()
    return _cls


def is_active() -> bool:
    """Whether this process runs on ``EepCpuPlatform`` (resolves vLLM's platform)."""
    from vllm.platforms import current_platform

    return type(current_platform).__name__ == "EepCpuPlatform"


def _build() -> type:
    from vllm.platforms.cpu import CpuPlatform

    from engine_ext.vllm.cpu_communicator import QUALNAME as COMMUNICATOR

    class EepCpuPlatform(CpuPlatform):
        """vLLM's CPU platform with DP + EP's collectives, a Ray device key, process workers under
        the Ray DP backend and synchronous EPLB."""

        # vLLM's Ray DP backend places each DP rank's workers on one unit each of this Ray resource
        # (v1/engine/utils.py:691,882); vLLM's CPU platform names none ("No  found in Ray cluster").
        # Not "CPU": a scale-up counts used units as ranks (utils.py:900-904), and every engine actor
        # also takes a CPU, so the joiner's local rank would overshoot (an assert in core.py:2204).
        # The cluster advertises it: `ray start --resources '{"vllm_cpu_rank": N}'`.
        ray_device_key: str = os.environ.get(DEVICE_KEY_ENV, "") or DEFAULT_DEVICE_KEY

        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return COMMUNICATOR

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            """vLLM's CPU checks, then: our variables reach Ray engine actors, workers are processes,
            and EPLB runs synchronously (its async worker thread asserts an accelerator device
            index, ``eplb/async_worker.py:32``, outside its ``try``: on CPU it dies at once)."""
            super().check_and_update_config(vllm_config)
            parallel = vllm_config.parallel_config
            if parallel.data_parallel_backend == "ray":
                # Ray starts each DP rank's engine actor with only the variables vLLM copies
                # (vllm/ray/ray_env.py): ours must reach it, or the actor runs vLLM's CPU platform.
                carried = os.environ.get(CARRY_ENV, "")
                if "EEPCTL_" not in carried.split(","):
                    os.environ[CARRY_ENV] = ",".join(p for p in (carried, "EEPCTL_") if p)
            if parallel.distributed_executor_backend == "ray" and workers_backend() == "mp":
                # vLLM picks Ray workers for the Ray DP backend (as on GPUs, the default here too:
                # engine_ext.vllm.cpu_ray makes them start on CPU); EEPCTL_VLLM_CPU_WORKERS=mp
                # starts each DP rank's workers as processes inside its engine actor instead.
                log.info("engine_ext: workers of each DP rank run as processes (mp), not Ray actors")
                parallel.distributed_executor_backend = "mp"
            if parallel.enable_eplb and parallel.eplb_config.use_async:
                log.warning(
                    "engine_ext: EPLB on CPU runs synchronously (use_async=False): its async "
                    "worker needs an accelerator stream"
                )
                parallel.eplb_config.use_async = False

    EepCpuPlatform.__module__ = __name__
    return EepCpuPlatform
