"""A vLLM deployment's prepared engine cores as its registry carries them, between eepctl and the API server.

`eepctl standby --count N` writes the desired count into the registry's info under ``DESIRED_KEY``
(a record with its own ``asked`` id); the plugin in the API server (engine_ext.vllm.standby) reads it
back every 2 s, resizes its held prepare, and publishes its state under ``info["standby"]`` with the
``asked`` id it applied. The registry is a detached actor of its own: the count outlives the vLLM
controller and eepctl. A record written before the API server started is not applied: a server's
start count is its ``EEPCTL_VLLM_STANDBY``. Pure functions, no Ray.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from engine_ext.protocol import PreconditionError

DESIRED_KEY = "standby_desired"
STANDBY_ENV = "EEPCTL_VLLM_STANDBY"


def desired_record(count: int, now: float | None = None) -> dict[str, Any]:
    """What `eepctl standby --count` writes into the registry's info."""
    return {
        DESIRED_KEY: {"count": int(count), "asked": uuid.uuid4().hex[:12], "at": time.time() if now is None else now}
    }


def to_apply(record: Any, applied: str | None, started: float) -> tuple[int, str] | None:
    """(count, asked id) of a desired record the API server has not applied yet, else None: no record,
    one already applied, one written before the server started, or one without a whole count >= 0."""
    if not isinstance(record, dict) or not record.get("asked") or record["asked"] == applied:
        return None
    count = record.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        return None
    if float(record.get("at") or 0) < started:
        return None
    return count, str(record["asked"])


def check_enabled(info: dict[str, Any], name: str) -> dict[str, Any]:
    """The API server's published held-prepare state; PreconditionError when it runs without the feature."""
    held = info.get("standby")
    if not isinstance(held, dict):
        raise PreconditionError(
            f"the vLLM server of {name!r} was started without {STANDBY_ENV}: start it with "
            f"{STANDBY_ENV}=0 (or a count) to keep engine cores prepared"
        )
    return held


def check_count(info: dict[str, Any], count: int) -> None:
    """DP + ``count`` must fit vLLM's ``--elastic-ep-max-dp-size``."""
    dp, max_dp = int(info.get("dp") or 1), int(info.get("max_dp") or 0)
    if count and dp + count > max_dp:
        raise PreconditionError(
            f"--count {count} needs DP {dp + count} prepared, past the server's --elastic-ep-max-dp-size {max_dp}"
        )


def progress(info: dict[str, Any], count: int, asked: str) -> str:
    """Where the API server stands with request ``asked``: "waiting", "done" or "failed"."""
    held = info.get("standby") or {}
    if held.get("asked") != asked:
        return "waiting"  # not read back yet
    if held.get("state") == "failed":
        return "failed"
    dp, max_dp = int(info.get("dp") or 1), int(info.get("max_dp") or 0)
    if count == 0 or dp + count > max_dp:  # nothing to hold (a scale may have taken DP to its bound)
        return "done" if held.get("prepared") is None and held.get("state") != "preparing" else "waiting"
    return "done" if held.get("state") == "prepared" and held.get("prepared") == dp + count else "waiting"


def summary(snap: dict[str, Any], count: int) -> dict[str, Any]:
    """`eepctl standby`'s result on a vLLM deployment, in the reference pool summary's terms (``size``,
    ``ready``: the prepared DP ranks, ``taken``: commits that adopted them) and vLLM's own."""
    info = snap.get("info") or {}
    held = info.get("standby") or {}
    dp = int(info.get("dp") or 1)
    prepared = held.get("prepared")
    return {
        "deployment": snap.get("deployment"),
        "kind": "vllm",
        "size": count,
        "ready": list(range(dp, int(prepared))) if prepared else [],
        "taken": int(held.get("adopted") or 0),
        "dp": dp,
        "max_dp": info.get("max_dp"),
        "prepared_dp": prepared,
        "state": held.get("state"),
        "prepare_s": held.get("prepare_s"),
        "drops": held.get("drops", 0),
        "drop_s": held.get("drop_s"),
        "error": held.get("error") or "",
        "standby_ranks": [
            {"rank": r["rank"], "pid": r.get("pid"), "instance_id": r.get("instance_id")}
            for r in snap.get("ranks") or []
            if r.get("state") == "standby"
        ],
    }
