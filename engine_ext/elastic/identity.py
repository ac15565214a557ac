"""DP-rank-suffixed identities (invariant I1).

Every rank's instance_id and KV-transfer engine_id end in ``_dp<global rank>``; Ray actor
names are derived from them, so two ranks sharing one would collide (vLLM PR #41792).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

_SUFFIX_RE = re.compile(r"(_dp\d+)+$")  # all trailing suffixes: re-basing also repairs a stacked id


def strip_dp_suffix(value: str) -> str:
    return _SUFFIX_RE.sub("", value)


def dp_suffixed(base: str, global_rank: int) -> str:
    if global_rank < 0:
        raise ValueError(f"global DP rank must be >= 0, got {global_rank}")
    return f"{strip_dp_suffix(base)}_dp{global_rank}"


def apply_dp_identity_suffix(config: Any, global_rank: int) -> Any:
    """Set ``instance_id`` and ``kv_transfer.engine_id`` to ``<base>_dp<global_rank>``.

    Works on frozen dataclasses (returns a copy) and on mutable objects (updated in place
    and returned). An already-suffixed value is re-based, never stacked.
    """
    instance_id = dp_suffixed(config.instance_id, global_rank)
    kv = getattr(config, "kv_transfer", None)
    engine_base = getattr(kv, "engine_id", None) if kv is not None else None
    new_kv = kv
    if kv is not None and engine_base:
        engine_id = dp_suffixed(engine_base, global_rank)
        new_kv = _set(kv, engine_id=engine_id)
    return _set(config, instance_id=instance_id, kv_transfer=new_kv)


def _set(obj: Any, **changes: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__") and getattr(obj.__dataclass_params__, "frozen", False):
        return replace(obj, **changes)
    for key, value in changes.items():
        setattr(obj, key, value)
    return obj


STANDBY_RANK_BASE = 100_000  # a standby's provisional rank number: outside every DP world


def standby_identity(base: str, n: int) -> str:
    """A standby's identity: ``<base>_standby<n>``, never a ``_dp<r>`` another rank may hold (I1)."""
    return f"{strip_dp_suffix(base)}_standby{n}"


def standby_number(base: str, name: str) -> int | None:
    """``n`` when ``name`` is the standby identity ``<base>_standby<n>`` (an adopted standby's Ray
    actor keeps that name), else None: the one reading of a standby's name."""
    head = f"{strip_dp_suffix(base)}_standby"
    rest = name[len(head) :]
    return int(rest) if name.startswith(head) and rest.isdigit() else None


def dp_rank_of(base: str, name: str) -> int | None:
    """``r`` when ``name`` is the DP identity ``<base>_dp<r>``, else None."""
    head = f"{strip_dp_suffix(base)}_dp"
    rest = name[len(head) :]
    return int(rest) if name.startswith(head) and rest.isdigit() else None
