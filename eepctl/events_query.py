"""Which operations and events `eepctl events` shows: the last N operations, an operation named by
its short id, the last operation for ``--timeline``. The data comes from ``core.events``; the
selection functions are pure.

An operation id is ``op-<date>-<time>-<hex>``; the table shows its shortest unique tail (the hex
part, longer only where two operations share it) and ``--op`` takes either form.
"""

from __future__ import annotations

import re
from typing import Any

from engine_ext.protocol import UsageError

DEFAULT_LAST = 20  # operations in the table without --last: about a screenful
_NO_EVENTS = 1 << 62  # a sequence number past every event: the operations alone


def _parts(op_id: str) -> list[str]:
    return op_id.split("-") if re.fullmatch(r"op-\d{8}-\d{6}-[0-9a-f]+", op_id) else [op_id]


def short_ids(op_ids: list[str]) -> dict[str, str]:
    """Each id's shortest tail of dash-separated parts that no other id in ``op_ids`` ends with."""
    out: dict[str, str] = {}
    for op_id in op_ids:
        parts = _parts(op_id)
        for n in range(1, len(parts) + 1):
            tail = "-".join(parts[-n:])
            if n == len(parts) or not any(o != op_id and (o == tail or o.endswith("-" + tail)) for o in op_ids):
                out[op_id] = tail if n < len(parts) else op_id
                break
    return out


def match_op(op_ids: list[str], text: str) -> str:
    """The full id ``text`` names: the id itself or a unique tail of it; unknown text is returned
    as it is (the registry then says no such operation exists)."""
    if text in op_ids:
        return text
    found = [o for o in op_ids if o.endswith("-" + text)]
    if len(found) > 1:
        raise UsageError(
            f"--op {text} matches {len(found)} operations ({', '.join(found[:4])}"
            f"{', ...' if len(found) > 4 else ''}): give more of the id"
        )
    return found[0] if found else text


def last_op_id(ops: list[dict[str, Any]]) -> str | None:
    """The operation that started last."""
    return max(ops, key=lambda o: o.get("started") or 0.0)["op_id"] if ops else None


def select(data: dict[str, Any], last: int | None) -> dict[str, Any]:
    """The last ``last`` operations (None: all) with their events, and the events of no operation
    (start-up, fences between operations) from the first one shown on; ``operations_total`` counts
    every operation the registry holds, ``short_ids`` gives each shown id's short form."""
    ops = sorted(data.get("operations", []), key=lambda o: o.get("started") or 0.0)
    shown = ops if last is None else ops[-last:] if last > 0 else []
    short = short_ids([o["op_id"] for o in ops])
    out = {
        **data,
        "operations": shown,
        "operations_total": len(ops),
        "short_ids": {o["op_id"]: short[o["op_id"]] for o in shown},
    }
    if len(shown) == len(ops):
        return out
    ids, all_ids = {o["op_id"] for o in shown}, {o["op_id"] for o in ops}
    since = (shown[0].get("started") or 0.0) if shown else float("inf")
    out["events"] = [
        e for e in data.get("events", []) if e["op_id"] in ids or (e["op_id"] not in all_ids and e["start"] >= since)
    ]
    return out


def resolve(t: Any, text: str) -> str:
    """The full id of the operation ``--op`` names (full or short) in deployment ``t``."""
    from eepctl import core

    if text.startswith("op-") and text.count("-") >= 3:
        return text
    ops = core.events(t, None, _NO_EVENTS)["operations"]
    return match_op([o["op_id"] for o in ops], text)


def last_op(t: Any) -> str:
    """The id of the deployment's newest operation (``events --timeline`` without ``--op``)."""
    from eepctl import core
    from engine_ext.protocol import UnreachableError

    found = last_op_id(core.events(t, None, _NO_EVENTS)["operations"])
    if found is None:
        raise UnreachableError(f"deployment {t.name!r} has no operation yet to draw")
    return found


def query(t: Any, op: str | None, last: int | None) -> dict[str, Any]:
    """What `events` shows: one operation and all its events (``op``), or the last ``last``."""
    from eepctl import core

    if op:
        data = core.events(t, op)
        return {**data, "short_ids": short_ids([o["op_id"] for o in data["operations"]])}
    return select(core.events(t), last)
