"""The invariants the registry can see broken from telemetry alone (DESIGN.md's I1-I5): from
the ranks' last reports, and from the ranks' phase events of each operation in the order the
registry received them. Pure functions of the registry's records: no Ray, no torch."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from engine_ext.records import DeploymentKind, Event, RankState, RankStatus
from engine_ext.transport import MAPPED

TERMINAL = {RankState.REMOVED.value}
_STACKED = re.compile(r"_dp\d+_dp\d+$")


def violation(invariant: str, rank: str, message: str) -> dict[str, str]:
    """One broken invariant as the snapshot's ``violations`` lists it."""
    return {"invariant": invariant, "rank": rank, "message": message}


def gone(st: RankStatus) -> bool:
    """The rank left the deployment: its last report is history, not a live rank's."""
    return st.state in TERMINAL


def rank_violations(ranks: Iterable[RankStatus]) -> list[dict[str, str]]:
    """I1, I3 and I4 from the ranks' last reports (a rank that left is not checked)."""
    found: list[dict[str, str]] = []
    seen: dict[str, int] = {}
    for v in (v for v in ranks if not gone(v)):
        rank = str(v.rank)
        if v.instance_id in seen:
            found.append(
                violation("I1", rank, f"duplicate identity {v.instance_id} (ranks {seen[v.instance_id]} and {v.rank})")
            )
        seen[v.instance_id] = v.rank
        # vLLM suffixes its identities only when it starts sibling DP engines (DP > 1).
        suffixed = v.kind != DeploymentKind.VLLM.value or v.dp_size > 1
        if v.state == "standby":  # named <base>_standby<N> until a scale-up adopts it (standby_rank)
            continue
        for field, value in (("instance_id", v.instance_id), ("engine_id", v.engine_id)):
            if value and ((suffixed and not value.endswith(f"_dp{v.rank}")) or _STACKED.search(value)):
                found.append(violation("I1", rank, f"{field} {value!r} does not end in exactly one _dp{v.rank}"))
        if v.workspace_locked and v.workspace_required_bytes and v.workspace_bytes < v.workspace_required_bytes:
            found.append(
                violation(
                    "I4",
                    rank,
                    f"workspace locked at {v.workspace_bytes} B below its bound {v.workspace_required_bytes} B",
                )
            )
        if v.stale_replays_refused:
            found.append(
                violation("I3", rank, f"{v.stale_replays_refused} replay(s) against a reallocated buffer refused")
            )
        eager = {s: n for s, n in v.eager_since_switch.items() if int(s) in v.capture_sizes_expected}
        if eager:
            sizes = ", ".join(f"{n} at batch size {s}" for s, n in eager.items())
            found.append(
                violation(
                    "I4",
                    rank,
                    f"decode steps served eagerly since {v.switch_op or 'start-up'} "
                    f"({sizes}): no capture for a size the config captures",
                )
            )
    return found


def event_violations(
    events: Sequence[tuple[int, Event]],
    capture_policy: str,
    left_at: Mapping[int, list[int]],
    kind: str = DeploymentKind.REFERENCE.value,
) -> list[dict[str, str]]:
    """I2, I4 and I5 from the ranks' phase events of each operation, in the order received
    (``events`` as ``(seq, event)``; ``left_at``: each rank's seqs at which it left). On a vLLM
    deployment the events are the plugin's hooks of vLLM's methods: a new engine core receives its
    weights in ``prepare_new_worker`` (phase ``transfer``) and never runs ``prepare_reconfiguration``
    (phase ``prepare``), so the communicator-before-transfer order is the reference engine's only."""
    found: list[dict[str, str]] = []
    passes: dict[tuple[str, int], int] = defaultdict(int)
    locks: dict[tuple[str, int], tuple[int, Event]] = {}
    comm_formed: set[tuple[str, int]] = set()
    for seq, e in events:
        key = (e.op_id, e.rank)
        if e.phase == "capture" and e.outcome == "ok":
            passes[key] += 1  # one event per pass, sent where the pass runs
        elif e.phase == "lock":
            locks[key] = (seq, e)
        elif e.phase == "prepare" and e.outcome == "ok":
            comm_formed.add(key)  # the groups and the EPLB communicator are formed
            found.extend(_transport_violations(e))
        elif e.phase == "transfer" and key not in comm_formed and kind == DeploymentKind.REFERENCE.value:
            # I2: the rank's report that it formed the communicator must arrive before its
            # weight transfer's: the order of receipt, not timestamps the rank writes.
            found.append(
                violation("I2", str(e.rank), f"weight transfer in {e.op_id} reported before the EPLB communicator was")
            )
        if e.phase == "warm":
            broken = [k for k in ("slots_restored", "live_kv_unchanged", "eplb_unchanged") if e.detail.get(k) is False]
            if broken:
                found.append(
                    violation(
                        "I5", str(e.rank), f"warm-up in {e.op_id} touched serving state ({', '.join(broken)} false)"
                    )
                )
    found.extend(_capture_violations(events, capture_policy, left_at, passes, locks))
    return found


def _transport_violations(e: Event) -> list[dict[str, str]]:
    """I2 for a shared-memory transport, from a rank's prepare: every member mapped the new world's
    segment, and it is as large as the new world's exchanges need."""
    d = e.detail
    if d.get("transport") not in MAPPED:
        return []
    found = []
    if d.get("transport_attached") != d.get("world"):
        message = f"shared memory of {e.op_id} prepared with {d.get('transport_attached')} of {d.get('world')} ranks"
        found.append(violation("I2", str(e.rank), message))
    if d.get("transport_bytes", 0) < d.get("transport_needed", 0):
        message = (
            f"shared memory of {e.op_id} takes {d['transport_bytes']} bytes per rank, "
            f"the new world's exchanges need {d['transport_needed']}"
        )
        found.append(violation("I2", str(e.rank), message))
    return found


def _capture_passes_expected(
    events: Sequence[tuple[int, Event]], policy: str, left_at: Mapping[int, list[int]], rank: int, lock_seq: int
) -> int:
    """I4's expectation, from the deployment's capture policy (the controller's record) and the
    rank's history here: under ``reuse`` a rank that locked an earlier world since it last
    (re)joined keeps its captures (0 passes); every other rank captures exactly once."""
    if policy != "reuse":
        return 1
    since = max((s for s in left_at.get(rank, []) if s < lock_seq), default=0)
    earlier = any(
        e.phase == "lock" and e.rank == rank and since < seq < lock_seq and e.outcome == "ok" for seq, e in events
    )
    return 0 if earlier else 1


def _capture_violations(
    events: Sequence[tuple[int, Event]],
    policy: str,
    left_at: Mapping[int, list[int]],
    passes: dict[tuple[str, int], int],
    locks: dict[tuple[str, int], tuple[int, Event]],
) -> list[dict[str, str]]:
    """I4: every rank that re-warmed and locked captured as many times as the registry expects,
    as its capture events show and as its own graph manager counted."""
    found: list[dict[str, str]] = []
    for (op_id, rank), (seq, lock) in locks.items():
        n = passes.get((op_id, rank), 0)
        counted = lock.detail.get("capture_passes")
        expected = _capture_passes_expected(events, policy, left_at, rank, seq)
        if n != expected:
            found.append(
                violation(
                    "I4",
                    str(rank),
                    f"{n} capture passes in one operation {op_id} (exactly {expected} expected under {policy})",
                )
            )
        elif counted != n:
            found.append(
                violation(
                    "I4", str(rank), f"graph manager counted {counted} capture passes in {op_id}, events show {n}"
                )
            )
        if lock.outcome != "ok":
            found.append(
                violation("I4", str(rank), f"workspace lock refused in {op_id}: {lock.detail.get('error', '')}")
            )
    for (op_id, rank), n in passes.items():
        if n > 1 and (op_id, rank) not in locks:
            found.append(violation("I4", str(rank), f"{n} capture passes in one operation {op_id}"))
    return found
