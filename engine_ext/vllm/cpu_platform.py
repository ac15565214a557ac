"""``vllm.platform_plugins`` entry: vLLM's CPU platform, opened for expert parallelism (opt-in).

``activate()`` returns this platform's qualified name only when the operator asks for it
(``EEPCTL_VLLM_CPU_EP=1``), vLLM would pick its CPU platform anyway, and the installed vLLM is
one the CPU patches were verified against (engine_ext.vllm.cpu_patches); otherwise ``None``, and
vLLM chooses its platform as if the plugin were absent (a GPU vLLM with the plugin installed
behaves exactly as before). vLLM resolves the platform in every process it starts, so each one
decides the same way from the same environment.

``EepCpuPlatform`` differs from vLLM's ``CpuPlatform`` only in its device communicator
(engine_ext.vllm.cpu_communicator: the variable-size collectives DP + EP needs). The class is
built on first access: importing this module imports nothing of vLLM.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("vllm.engine_ext")

ENABLE_ENV = "EEPCTL_VLLM_CPU_EP"
QUALNAME = "engine_ext.vllm.cpu_platform.EepCpuPlatform"
_cls: type | None = None


def requested(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ENABLE_ENV, "") == "1"


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
        """vLLM's CPU platform with a device communicator that has DP + EP's collectives."""

        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return COMMUNICATOR

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            """vLLM's CPU checks, then: EPLB runs synchronously. Its async worker thread needs an
            accelerator device index (``eplb/async_worker.py:32``); on CPU the thread dies at once
            and the mapping changes while the weights stay where they were."""
            super().check_and_update_config(vllm_config)
            parallel = vllm_config.parallel_config
            if parallel.enable_eplb and parallel.eplb_config.use_async:
                log.warning("engine_ext: EPLB on CPU runs synchronously (use_async=False): its async "
                            "worker needs an accelerator stream")
                parallel.eplb_config.use_async = False

    EepCpuPlatform.__module__ = __name__
    return EepCpuPlatform
