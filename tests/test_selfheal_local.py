"""Self-healing with the process launcher: a real SIGKILL of a serving rank under load; the
survivors degrade instead of failing, a recovery operation rebuilds the world, the dead rank's
requests continue on survivors, and every output equals the oracle's (issue 10)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
from tests.engine_helpers import (
    kill_between_steps,
    oracle_mismatch,
    run,
    wait_decoding,
    wait_until,
    watch_reported_states,
)
from tests.helpers import moved_off

MAX_TOKENS = 24
PROMPTS = [[(13 * i + 7 * j + 1) % 256 for j in range(3 + i % 9)] for i in range(18)]


def _cfg(**kw: object) -> EngineConfig:
    return EngineConfig(dtype="float64", **{"capture_policy": "recapture", **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return reference_generate(_cfg(slots_per_rank=6), PROMPTS, MAX_TOKENS)


async def _kill_while_decoding(dep: LocalDeployment, victim: int) -> None:
    """SIGKILL ``victim`` by pid while requests decode on it."""
    await wait_decoding(dep, victim)
    os.kill(dep.processes[victim].pid(), signal.SIGKILL)


async def _load_with_kill(dep: LocalDeployment, victim: int, *, rate_per_s: float = 12.0) -> list[tuple[int, dict]]:
    """Open-loop arrivals; SIGKILL ``victim`` by pid while requests decode on it."""

    async def arrivals() -> list[tuple[int, asyncio.Task]]:
        tasks = []
        for i, p in enumerate(PROMPTS):
            tasks.append((i, asyncio.ensure_future(dep.generate(p, MAX_TOKENS))))
            await asyncio.sleep(1.0 / rate_per_s)  # the arrival rate
        return tasks

    sender = asyncio.ensure_future(arrivals())
    await asyncio.wait_for(_kill_while_decoding(dep, victim), 60)
    return [(i, await asyncio.wait_for(t, 120)) for i, t in await sender]


def _statuses(dep: LocalDeployment) -> dict[int, dict]:
    return {r: dep.registry.ranks[r] for r in dep.orch.members if r in dep.registry.ranks}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [1, 0], ids=["serving-rank", "store-host"])
def test_serving_rank_sigkill_recovers_with_no_request_lost(reference: list[dict], victim: int) -> None:
    async def scenario() -> None:
        async with LocalDeployment(_cfg(slots_per_rank=6), f"heal{victim}", max_dp=4, on_rank_failure="shrink") as dep:
            await dep.start(3)
            states = watch_reported_states(dep)
            results = await _load_with_kill(dep, victim)
            assert [r.get("error") for _, r in results if r.get("error")][:2] == []
            # degrade-vs-fail: the survivors took the peer's death for a peer's failure, none failed
            # (they degraded, or the recovery's halt reached them first; `no_degrade` shows the harm)
            assert not any("failed" in states.get(r, set()) for r in range(3)), states
            assert oracle_mismatch(results, reference, logits=False) == ""
            await dep.orch.recovery.wait()
            assert dep.orch.members == [r for r in range(3) if r != victim]
            ops = [op for op in dep.orch.history if op.get("kind") == "recover"]
            assert ops and ops[-1]["state"] == "succeeded", ops
            assert ops[-1]["dead_ranks"] == [victim]
            regroup = [
                e
                for e in dep.registry.events_for(ops[-1]["op_id"])
                if e.get("phase") == "regroup" and e.get("rank") == -1
            ]
            # store re-hosting: only when the store's host died, a survivor hosts a new one
            assert [e["detail"]["new_store_host"] for e in regroup] == ([1] if victim == 0 else []), regroup
            assert set(ops[-1]["captures_per_rank"].values()) == {1}  # I4: exactly one capture
            assert dep.orch.router.rerouted >= 1, "the victim had requests in flight"
            moved_off([r for _, r in results], victim)  # ... which continued elsewhere with their tokens
            # The survivors serve, keep their identities (I1) and see the new DP size (I6).
            await wait_until(
                lambda: (
                    all(s.state == "serving" and s.dp_size == 2 for s in _statuses(dep).values())
                    and len(_statuses(dep)) == 2
                ),
                10,
                "survivors serving at DP 2",
            )
            for r, st in _statuses(dep).items():
                assert st.instance_id.endswith(f"_dp{r}")
            # After recovery a normal scale up and down works.
            up = await dep.scale(3)
            assert up["state"] == "succeeded", up
            assert dep.orch.members == [r for r in range(3) if r != victim] + [3]
            again = await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS[:6]))
            assert oracle_mismatch(list(enumerate(again)), reference, logits=False) == ""
            down = await dep.scale(2)
            assert down["state"] == "succeeded", down

    run(scenario(), 220)


@pytest.mark.timeout(120)
@pytest.mark.harm("no_token_stream")
def test_without_token_streaming_moved_requests_restart_from_the_prompt(reference: list[dict]) -> None:
    """The fault no_token_stream switches the rank's token stream off: greedy outputs still equal
    the oracle (so an output check alone cannot see it), but the moved requests arrive on the
    survivor with no tokens (resumed_with 0), and ``moved_off`` fails, as the kill tests rely on."""

    async def scenario() -> None:
        async with LocalDeployment(
            _cfg(slots_per_rank=6, faults=["no_token_stream"]), "heal-nostream", max_dp=4, on_rank_failure="shrink"
        ) as dep:
            await dep.start(3)
            results = await _load_with_kill(dep, 1)
            assert oracle_mismatch(results, reference, logits=False) == ""
            moved = [r for _, r in results if 1 in r["moved_from"]]
            assert moved and all(r["resumed_with"] == 0 for r in moved), moved
            with pytest.raises(AssertionError, match="restarted from their prompts"):
                moved_off([r for _, r in results], 1)

    run(scenario(), 110)


@pytest.mark.timeout(240)
def test_replace_policy_grows_back_to_desired_size(reference: list[dict]) -> None:
    """Then, on the world grown back to DP 4, the group abort firing: a rank killed between steps
    with its death reported late leaves a survivor blocked on a survivor in the next step's gloo
    ring (tests/engine_helpers.py::kill_between_steps); with a 60 s step timeout only the abort
    releases it within the recovery's 10 s halt, and the recovery succeeds (the harm without it:
    test_selfheal_mechanisms.py's no_group_abort)."""

    async def scenario() -> None:
        async with LocalDeployment(
            _cfg(slots_per_rank=6, transport="gloo", step_timeout_s=60.0), "heal-replace", max_dp=4
        ) as dep:
            await dep.start(4)
            victim_pid = dep.processes[3].pid()
            results = await _load_with_kill(dep, 3)
            assert oracle_mismatch(results, reference, logits=False) == ""
            moved_off([r for _, r in results], 3)  # killed mid-decode: its requests continued with their tokens
            await wait_until(lambda: len(dep.orch.members) == 4 and not dep.orch.busy(), 120, "DP 4 again")
            await dep.orch.recovery.wait()
            # the replacement takes the dead rank's number (free again), in a new process
            assert dep.orch.members == [0, 1, 2, 3] and dep.processes[3].pid() != victim_pid
            kinds = [(op.get("kind"), op.get("cause")) for op in dep.orch.history]
            assert kinds[-2:] == [("recover", ""), ("scale", "replace")], kinds  # events names it a grow
            # [0, 1, 2, 3]: rank 1 dies idle; rank 2 fails on its connection; rank 3, whose ring
            # neighbours are ranks 2 and 0, waits on rank 2 (at DP 3 every rank neighbours the victim)
            results = await kill_between_steps(dep, 1, PROMPTS, MAX_TOKENS, 120)
            assert None not in results, "a request was not answered within 120 s"
            assert oracle_mismatch(list(enumerate(results)), reference, logits=False) == ""
            await wait_until(lambda: len(dep.orch.members) == 4 and not dep.orch.busy(), 120, "DP 4 again")
            await dep.orch.recovery.wait()
            ops = [op for op in dep.orch.history if op.get("kind") == "recover"]
            assert [(op["state"], op["dead_ranks"]) for op in ops] == [("succeeded", [3]), ("succeeded", [1])], ops

    run(scenario(), 220)


@pytest.mark.timeout(240)
def test_expert_only_on_dead_rank_restored_from_weight_source() -> None:
    cfg = _cfg(num_experts=16, slots_per_rank=6)
    ref = reference_generate(cfg, PROMPTS, MAX_TOKENS)

    async def scenario() -> None:
        async with LocalDeployment(cfg, "heal-ws", max_dp=4, on_rank_failure="shrink") as dep:
            await dep.start(4)
            layout = dep.orch.layout
            victim = 1
            only_there = [
                e for e in layout.local_logical(victim) if all(layout.rank_of(p) == victim for p in layout.replicas(e))
            ]
            assert only_there, "the test needs an expert whose only copy is on the victim"
            results = await _load_with_kill(dep, victim)
            assert oracle_mismatch(results, ref, logits=False) == ""
            moved_off([r for _, r in results], victim)  # killed mid-decode: its requests continued with their tokens
            await dep.orch.recovery.wait()
            op = [op for op in dep.orch.history if op.get("kind") == "recover"][-1]
            assert op["state"] == "succeeded", op
            events = [e for e in dep.registry.events_for(op["op_id"]) if e.get("phase") == "rebuild"]
            restored = events[-1]["detail"]["restored_from_weight_source"]
            assert set(only_there) <= set(restored)

    run(scenario(), 220)


@pytest.mark.timeout(240)
def test_two_ranks_killed_at_once(reference: list[dict]) -> None:
    async def scenario() -> None:
        async with LocalDeployment(_cfg(slots_per_rank=6), "heal-two", max_dp=4, on_rank_failure="shrink") as dep:
            await dep.start(4)
            tasks = [asyncio.ensure_future(dep.generate(p, MAX_TOKENS)) for p in PROMPTS]
            await asyncio.wait_for(asyncio.gather(wait_decoding(dep, 1), wait_decoding(dep, 2)), 60)
            for victim in (1, 2):
                os.kill(dep.processes[victim].pid(), signal.SIGKILL)
            results = [await asyncio.wait_for(t, 120) for t in tasks]
            assert oracle_mismatch(list(enumerate(results)), reference, logits=False) == ""
            for victim in (1, 2):  # both held requests mid-decode, which continued on a survivor
                moved_off(results, victim)
            await dep.orch.recovery.wait()
            assert dep.orch.members == [0, 3]
            ops = [op for op in dep.orch.history if op.get("kind") == "recover"]
            assert [op["state"] for op in ops] == ["succeeded"] and ops[0]["dead_ranks"] == [1, 2], ops

    run(scenario(), 220)


# (faults, start DP, target DP, victim, members afterwards, the scale's end state, the dead ranks of
#  each recovery recorded afterwards (a joiner dead in commit: a rebuild with none dead)). A removing
#  rank is killed while held, so before it left: its death fails the scale (rolled back in drain)
#  and a recovery removes it.
HELD = {
    "joiner-in-launch": (["hold:launch@3"], 3, 4, 3, [0, 1, 2], "rolled_back", []),
    "joiner-in-prepare": (["hold:prepare@3"], 3, 4, 3, [0, 1, 2], "rolled_back", []),
    "joiner-in-transfer": (["hold:transfer@3"], 3, 4, 3, [0, 1, 2], "rolled_back", []),
    "joiner-in-commit": (["hold:commit@3"], 3, 4, 3, [0, 1, 2], "failed", [[]]),
    "standby-in-adopt": (["hold:adopt@3"], 3, 4, 3, [0, 1, 2, 3], "succeeded", []),
    "member-in-prepare": (["hold:prepare@1"], 3, 4, 1, [0, 2], "rolled_back", [[1]]),
    # a sender mid pre-copy (rank 1 sends joiner 3 two experts: held after the first)
    "member-in-precopy": (["hold:precopy@1"], 3, 4, 1, [0, 2], "rolled_back", [[1]]),
    "store-host-in-commit": (["hold:commit@0"], 3, 4, 0, [1, 2], "failed", [[0]]),
    "removing-in-drain": (["hold:drain@3"], 4, 3, 3, [0, 1, 2], "rolled_back", [[3]]),
    "removing-in-commit": (["hold:commit@3"], 4, 3, 3, [0, 1, 2], "failed", [[3]]),
    "removing-in-reshuffle": (["hold:reshuffle@3"], 4, 3, 3, [0, 1, 2], "failed", [[3]]),
    "member-in-commit": (["hold:commit@1"], 3, 4, 1, [0, 2], "failed", [[1]]),
    "member-in-reshuffle": (["hold:reshuffle@1"], 3, 4, 1, [0, 2], "failed", [[1]]),
    "member-in-warm": (["hold:warm@1"], 3, 4, 1, [0, 2], "failed", [[1]]),
    "member-in-capture": (["hold:capture@1"], 3, 4, 1, [0, 2], "failed", [[1]]),
}


async def _kill_when_held(
    dep: LocalDeployment, rank: int, phase: str, *, scale: asyncio.Future | None = None, with_requests: bool = False
) -> int:
    """SIGKILL the process that reports itself as ``rank`` held in ``phase``, by the pid it
    reported (a standby being adopted is in no member table yet). Returns that pid.
    ``with_requests``: only once the held rank also owns a request that streamed tokens, read from
    the router every 2 ms (a heartbeat report, a second apart, misses requests that take tens of ms).
    A ``scale`` that ends before the hold is seen fails the test with its record."""

    def held() -> bool:
        st = dep.registry.ranks.get(rank)
        return (scale is not None and scale.done()) or (st is not None and f"held in {phase}" in st.state_reason)

    def says() -> str:  # what the rank and the router said last, for a failure's message
        st = dep.registry.ranks.get(rank)
        return (
            f"rank {rank}: {st.state if st else None} {st.state_reason if st else ''!r}, "
            f"{dep.orch.router.inflight.get(rank, 0)} request(s) in flight on it"
        )

    try:
        await wait_until(held, 60, f"rank {rank} held in {phase}")
    except AssertionError as ex:
        raise AssertionError(f"{ex}; {says()}") from None
    if scale is not None and scale.done():
        raise AssertionError(
            f"the scale ended before rank {rank} was held in {phase}: {scale.exception() or scale.result()!r}; {says()}"
        )
    seen = time.monotonic()
    pid = dep.registry.ranks[rank].pid
    if with_requests:
        # a hold outside PAUSED_PHASES is a timer (fault_delay_s from before it was seen): a kill after
        # it would land in a later phase and end the scale otherwise, so the moment must be inside it
        window = dep.cfg.fault_delay_s - 1.0
        await wait_until(
            lambda: dep.orch.router.mid_decode(rank) > 0 or time.monotonic() - seen > window,
            60,
            f"rank {rank} held in {phase} mid-decode",
            interval_s=0.002,
        )
        assert time.monotonic() - seen <= window, (
            f"no request was mid-decode on rank {rank} in the {window:.0f}s its hold in {phase} had left: missed"
        )
    os.kill(pid, signal.SIGKILL)
    return pid


async def _steady_load(
    dep: LocalDeployment, stop: asyncio.Event, rate_per_s: float = 6.0
) -> list[tuple[int, asyncio.Task]]:
    """Open-loop arrivals cycling through PROMPTS until ``stop``: whenever a phase is reached, every
    serving rank holds requests, some mid-decode. Returns (prompt index, task) of each."""
    tasks: list[tuple[int, asyncio.Task]] = []
    while not stop.is_set():
        i = len(tasks) % len(PROMPTS)
        tasks.append((i, asyncio.ensure_future(dep.generate(PROMPTS[i], MAX_TOKENS))))
        await asyncio.sleep(1.0 / rate_per_s)  # the arrival rate
    return tasks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(HELD))
def test_rank_killed_while_held_in_a_scale_phase(reference: list[dict], case: str) -> None:
    faults, start, target, victim, members, scale_state, recovered = HELD[case]
    # a member held by a timer (prepare, pre-copy) is killed once a request is mid-decode on it: a
    # longer hold leaves room for that on a loaded box (the kill ends it early, so it costs nothing)
    timed_member = faults[0].split(":")[1].split("@")[0] in ("prepare", "precopy") and victim < start < target
    # one move per exchange (move_batch_bytes=0): a hold after the first is mid pre-copy
    cfg = _cfg(slots_per_rank=6, faults=faults, fault_delay_s=8.0 if timed_member else 4.0, move_batch_bytes=0)
    standby = 1 if case.startswith("standby") else 0

    async def scenario() -> None:
        async with LocalDeployment(cfg, f"heal-{case}", max_dp=4, on_rank_failure="shrink", standby=standby) as dep:
            await dep.start(start)
            # a scale-down names its leaver: by default the least-loaded ranks leave, and the hold is on the victim
            retire = [victim] if target < start else None
            stop = asyncio.Event()
            phase = faults[0].split(":")[1].split("@")[0]
            # held mid pre-copy, the old world serves on at full speed (a request is over in about
            # 0.15 s on shared memory): more arrivals, so a report from the hold finds one running
            load = asyncio.ensure_future(_steady_load(dep, stop, 14.0 if phase == "precopy" else 6.0))
            scale = asyncio.ensure_future(dep.scale(target, timeout_s=120, retire=retire))
            # a member that serves on in the new world is killed holding requests (a removing rank
            # may have drained its own); a joiner or a standby never held one
            member = victim < start and target > start
            killed = await _kill_when_held(dep, victim, phase, scale=scale, with_requests=member)
            stop.set()
            op = await asyncio.wait_for(scale, 120)
            assert op["state"] == scale_state, op
            results = [(i, await asyncio.wait_for(t, 120)) for i, t in await load]
            assert oracle_mismatch(results, reference, logits=False) == ""
            if member:  # its requests moved to a survivor and continued with the tokens they had
                moved_off([r for _, r in results], victim)
            elif victim >= start:  # nothing was ever routed to the joiner (or the standby)
                assert not [r for _, r in results if victim in (r.get("moved_from") or [])], results
            await dep.orch.recovery.wait()
            assert dep.orch.members == members
            recovers = [o for o in dep.orch.history if o.get("kind") == "recover"]
            # the records say what happened: who died, and that the world healed
            assert [(o["state"], o["dead_ranks"]) for o in recovers] == [("succeeded", d) for d in recovered], [
                (o["state"], o["dead_ranks"], o.get("error"), o.get("started")) for o in recovers
            ] + [op]
            if standby:  # the standby died in its adoption: the scale launched a fresh rank instead
                assert dep.pool is not None and dep.pool.taken == 0
                assert dep.processes[victim].pid() != killed
            again = await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS[8:12]))
            assert oracle_mismatch([(8 + i, r) for i, r in enumerate(again)], reference, logits=False) == ""

    run(scenario(), 220)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "variant",
    [[], pytest.param(["precopy_into_live_slots"], marks=pytest.mark.harm("precopy_into_live_slots"))],
    ids=["spare-buffers", "into-live-slots"],
)
def test_sender_killed_mid_precopy_leaves_the_survivors_experts_whole(variant: list[str]) -> None:
    """DP 4 -> 3 retiring rank 3, which sends remaining rank 1 two experts in the pre-copy (16
    experts, 6 slots per rank): rank 3 is held after the first and SIGKILLed while rank 1 holds
    what it received. The scale rolls back and a recovery removes rank 3. Received into spare
    buffers, rank 1's slots never changed: every output equals the oracle. Received into the slots
    it serves from (the variant), the old world serves moved experts: wrong tokens. Requests sent
    while rank 3 is held are served then, by the old world, mid pre-copy."""
    base = _cfg(num_experts=16, slots_per_rank=6)
    ref = reference_generate(base, PROMPTS, MAX_TOKENS)
    # one move per exchange (move_batch_bytes=0): a hold after the first finds the second not yet received
    cfg = _cfg(
        num_experts=16, slots_per_rank=6, faults=["hold:precopy@3", *variant], fault_delay_s=8.0, move_batch_bytes=0
    )

    async def scenario() -> None:
        async with LocalDeployment(cfg, "heal-precopy", max_dp=4, on_rank_failure="shrink") as dep:
            await dep.start(4)
            plan = await dep.orch.plan(3, retire=[3])
            assert len([m for m in plan.expert_moves if (m["src_rank"], m["dst_rank"]) == (3, 1)]) >= 2, plan
            spare = plan.precopy["per_rank"]["1"]["spare"]
            assert spare > 0, plan.precopy
            stop = asyncio.Event()
            load = asyncio.ensure_future(_steady_load(dep, stop))
            scale = asyncio.ensure_future(dep.scale(3, timeout_s=120, retire=[3]))
            # (received into live slots, rank 1 holds spare buffers for its local moves only)
            await wait_until(
                lambda: (
                    "held in precopy" in dep.registry.ranks[3].state_reason
                    and (bool(variant) or dep.registry.ranks[1].move_bytes_held == spare)
                ),
                60,
                "rank 3 held mid pre-copy while rank 1 holds its spare buffers",
            )
            # served by the old world while the pre-copy is held half way (about 1.3 s for 8 here)
            during = await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS[:8]))
            os.kill(dep.registry.ranks[3].pid, signal.SIGKILL)
            stop.set()
            op = await asyncio.wait_for(scale, 120)
            assert op["state"] == "rolled_back", op
            results = [(i, await asyncio.wait_for(t, 120)) for i, t in await load]
            await dep.orch.recovery.wait()
            assert dep.orch.members == [0, 1, 2]
            recovers = [o for o in dep.orch.history if o.get("kind") == "recover"]
            assert [(o["state"], o["dead_ranks"]) for o in recovers] == [("succeeded", [3])]
            again = await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS[8:12]))
            mismatch = oracle_mismatch(
                list(enumerate(during)) + results + [(8 + i, r) for i, r in enumerate(again)], ref, logits=False
            )
            if variant:  # the harm: the old world served experts moved into its live slots
                assert mismatch != ""
                return
            assert mismatch == ""
            # the abort gave the spare bytes back to the KV pool
            await wait_until(
                lambda: all(dep.registry.ranks[r].move_bytes_held == 0 for r in (0, 1, 2)), 10, "spare buffers freed"
            )

    run(scenario(), 220)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("report_delay_s", [0.0, 2.0], ids=["reported-at-once", "reported-late"])
def test_second_death_during_a_recovery(reference: list[dict], report_delay_s: float) -> None:
    """Rank 1 dies under load; while the recovery holds survivor 2 at its regroup, rank 2 dies
    too. The deployment still ends in one healthy world of the other survivors, no request lost.
    ``reported-late``: rank 2's death is reported 2 s after its pipe closed (as Ray's comes
    seconds late), so the recovery fails on a death nobody reported yet; it probes the survivors
    before calling the world unhealthy (without that probe all four ranks were rebuilt from the
    weight source, seen once in CI)."""
    cfg = _cfg(slots_per_rank=6, faults=["hold:regroup@2"], fault_delay_s=4.0)

    async def scenario() -> None:
        async with LocalDeployment(
            cfg, "heal-second", max_dp=4, on_rank_failure="shrink", death_report_delay_s=report_delay_s
        ) as dep:
            await dep.start(4)
            tasks = [asyncio.ensure_future(dep.generate(p, MAX_TOKENS)) for p in PROMPTS]
            await asyncio.wait_for(wait_decoding(dep, 1), 60)  # every rank steps: rank 2's requests decode too
            os.kill(dep.processes[1].pid(), signal.SIGKILL)
            await _kill_when_held(dep, 2, "regroup")
            results = [await asyncio.wait_for(t, 150) for t in tasks]
            assert [r["error"] for r in results if r.get("error")] == []
            assert oracle_mismatch(list(enumerate(results)), reference, logits=False) == ""
            for victim in (1, 2):  # each held requests with tokens, which continued on a survivor
                moved_off(results, victim)
            await dep.orch.recovery.wait()
            assert dep.orch.members == [0, 3]
            recovers = [o for o in dep.orch.history if o.get("kind") == "recover"]
            # the records say what happened: the first recovery failed on rank 2's death, the next healed both
            assert [(o["state"], o["dead_ranks"]) for o in recovers] == [("failed", [1]), ("succeeded", [1, 2])]
            assert "rank 2" in recovers[0]["error"], recovers[0]
            again = await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS[:4]))
            assert oracle_mismatch(list(enumerate(again)), reference, logits=False) == ""

    run(scenario(), 220)
