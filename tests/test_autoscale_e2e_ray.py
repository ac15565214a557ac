"""The autoscaler end to end on a real local Ray cluster (issue 24): the controller's own reconcile
loop runs it, real open-loop load (`eepctl generate --rate`, subprocesses) moves it, real gloo
transitions act on it, a real SIGKILL (by pid) interrupts it. One deployment, one scenario:

1. `scale --dp 2 --retire 1` through Ray: the dry run shows the default choice (the emptiest) and
   the named one; exactly rank 1 leaves.
2. Advisory mode under a 4x load step: recommendations recorded and shown (`status`, `events
   --autoscaler`), 0 operations.
3. Mode on, load wandering inside the tolerance band: 0 operations.
4. Mode on with the load rule added (``--target-utilization``, low enough that the step needs
   every rank whatever the machine's speed) and ``--max-step 1``, a 4x load step with a member
   SIGKILLed (by pid) as it begins, its recovery held at its regroup by a test fault: no decision
   acted on from the kill to the recovery's end; then the autoscaler scales the survivor up
   1 -> 3 in one decision (the load rule's jump: no max step upward), its record showing the
   rule's arithmetic, once its asks were held for the up-delay (asks made while the recovery
   blocked count), at most a tick or two after both the up-delay and the recovery passed.
5. Load gone: down (to 1) only once the down-delay passed, the ranks with the least work leaving.
Every request of every load succeeds and equals the oracle.

The queue target is measured, not guessed: the base load's queue per rank, read from the
advisory decisions, sets ``--target-queue`` (2x it), so the base load sits inside the band
whatever the machine's speed and a 4x step is far outside it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tests.helpers import (
    NAMESPACE,
    SMALL_ENGINE,
    eepctl,
    eepctl_json,
    events,
    finish_load,
    json_lines,
    scale_json,
    wait_for,
)

pytestmark = pytest.mark.ray

RATE = 2.0  # base load, requests/s
TOKENS = 64  # long enough that a quiet machine's base load still shows requests at the ranks
# DOWN_DELAY: long enough that the scale-down cannot start before the test, polling through eepctl
# processes on a loaded 2-core box, has seen the grown world serve (at 10 s a two-lane CI run saw
# the down begin first, and waited out 120 s for a world that had already shrunk)
UP_DELAY, DOWN_DELAY, COOLDOWN, WINDOW, TOLERANCE = 2.0, 25.0, 2.0, 4.0, 0.8
HOLD_S = 6.0  # a recovery's survivors wait this long at its regroup (the "hold:regroup" test fault)


def _status(name: str) -> dict[str, Any] | None:
    res = eepctl("status", "--name", name, "-o", "json", timeout=60)
    return json_lines(res.stdout)[-1] if res.returncode == 0 else None


def _serving(name: str, ranks: list[int], timeout: float = 120.0) -> dict[str, Any]:
    """Status once exactly ``ranks`` serve at DP len(ranks) and no operation runs; failing, it
    says what status showed last."""
    seen: list[Any] = [None]

    def ok() -> dict[str, Any] | None:
        s = _status(name)
        if s is None:
            return None
        seen[0] = ([(r["rank"], r["state"], r["dp_size"]) for r in s["ranks"]], (s.get("operation") or {}).get("op_id"))
        live = [r for r in s["ranks"] if r["state"] not in ("stale", "removed", "fenced", "dead")]
        if (
            sorted(r["rank"] for r in live) == ranks
            and not s.get("operation")
            and all(r["state"] == "serving" and r["dp_size"] == len(ranks) for r in live)
        ):
            return s
        return None

    try:
        return wait_for(ok, timeout=timeout, interval=0.5, what=f"{name}: ranks {ranks} serving")
    except AssertionError as ex:
        raise AssertionError(f"{ex}; status showed last (rank, state, DP), operation: {seen[0]}") from None


def _ops(name: str) -> list[dict[str, Any]]:
    return [o for o in events(name)["operations"] if o.get("kind") in ("scale", "recover", "rebuild")]


def _decisions(name: str) -> list[dict[str, Any]]:
    return eepctl_json("events", "--name", name, "--autoscaler", timeout=60)["decisions"]


def _queue(d: dict[str, Any]) -> float | None:
    return next((s["value"] for s in d["signals"] if s["name"] == "queue"), None)


def _load(dep: Any, rate: float, duration: float) -> Any:
    return dep.popen(
        "generate",
        "--name",
        dep.name,
        "--rate",
        str(rate),
        "--duration",
        str(duration),
        "--max-tokens",
        str(TOKENS),
        "-o",
        "json",
    )


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _idle_cpu(name: str, snap: dict[str, Any], seconds: float) -> str:
    """The controller's and each rank's CPU share over ``seconds`` of no load (a figure, not a check)."""
    import ray
    from engine_ext.ray.names import controller_name

    pids = {"controller": ray.get(ray.get_actor(controller_name(name), namespace=NAMESPACE).pid.remote(), timeout=30)}
    pids.update({f"rank {r['rank']}": int(r["pid"]) for r in snap["ranks"] if r.get("pid")})
    before = {k: _cpu_s(p) for k, p in pids.items()}
    time.sleep(seconds)
    return ", ".join(f"{k} {100 * (_cpu_s(p) - before[k]) / seconds:.1f}% CPU" for k, p in pids.items())


def _set_policy(name: str, changes: dict[str, Any]) -> None:
    import ray
    from engine_ext.ray.names import controller_name

    ctl = ray.get_actor(controller_name(name), namespace=NAMESPACE)
    res = ray.get(ctl.set_autoscale.remote(changes), timeout=30)
    assert "error" not in res, res


def _acted(trail: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in trail if d["act"]]


def _up_timing(trail: list[dict[str, Any]], rec: dict[str, Any], up: dict[str, Any]) -> tuple[float, float]:
    """(how long the asks behind the up had been held when it was decided, how long after both
    the up-delay and the recovery had passed the up began). The asks are the unbroken run of raw
    recommendations above the size the acting decision saw, ending at that decision."""
    act = next(d for d in _acted(trail) if d["at"] >= rec["finished"])
    start = act["at"]
    for d in reversed([d for d in trail if d["at"] <= act["at"]]):
        if d["raw_recommendation"] <= act["current_dp"]:
            break
        start = d["at"]
    return act["at"] - start, up["started"] - max(start + UP_DELAY, rec["finished"])


def _settled_ups(name: str, rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The scale-ups after the recovery once the load is gone: the newest decision no longer asks
    up and no operation runs. One up, 1 -> 3: the load rule's jump; it succeeded."""

    def settled() -> list[dict[str, Any]] | None:
        trail, s = _decisions(name), _status(name)
        if not trail or s is None or s.get("operation") or trail[-1]["raw_recommendation"] > trail[-1]["current_dp"]:
            return None
        return [
            o
            for o in _ops(name)
            if o["started"] >= rec["finished"] and not (o["kind"] == "scale" and o["to_size"] < o["from_size"])
        ]

    ops = wait_for(settled, timeout=60, interval=0.5, what="the load gone and no operation running")
    assert [(o["kind"], o["state"], o["from_size"], o["to_size"]) for o in ops] == [("scale", "succeeded", 1, 3)], ops
    return ops


@pytest.mark.timeout(420)
def test_autoscaler_advisory_band_step_kill_and_down_on_ray(deployments) -> None:
    from eepctl import core

    t0 = time.time()
    dep = deployments("as-e2e")
    engine = dict(SMALL_ENGINE, step_timeout_s=4.0, faults=["hold:regroup"], fault_delay_s=HOLD_S)
    core.up(
        core.Target(name=dep.name, namespace=NAMESPACE),
        dp=3,
        max_dp=3,
        engine=engine,
        cpus_per_rank=1.0,
        gpus_per_rank=0.0,
        timeout_s=300,
        on_rank_failure="shrink",
        health_deadline_s=4.0,
    )
    cfg_d = _serving(dep.name, [0, 1, 2])["info"]["config"]

    # 1. --retire through Ray: the dry runs show the choice; exactly the named rank leaves.
    default = eepctl_json("scale", "--dp", "2", "--name", dep.name, "--dry-run")
    assert [(j["rank"], j["chosen_by"]) for j in default["leaving"]] == [(2, "least work")], default["leaving"]
    named = eepctl("scale", "--dp", "2", "--name", dep.name, "--retire", "1", "--dry-run")
    assert named.returncode == 0 and "leave  rank 1 (as-e2e_dp1), named by --retire" in named.stdout, named.stdout
    op = scale_json(dep.name, 2, "--retire", "1")
    assert op["state"] == "succeeded" and [j["rank"] for j in op["plan"]["leaving"]] == [1], op
    _serving(dep.name, [0, 2])
    t_ready = time.time()
    ops_before = len(_ops(dep.name))

    # 2. Advisory under a 4x step: recorded and shown, nothing done.
    # A low target: the step (or a slow machine's base load) is certainly recommended up; advisory
    # mode must record that and do nothing.
    res = eepctl_json(
        "autoscale",
        "--name",
        dep.name,
        "--min-dp",
        "1",
        "--max-dp",
        "3",
        "--target-queue",
        "0.3",
        "--up-delay",
        str(UP_DELAY),
        "--down-delay",
        str(DOWN_DELAY),
        "--cooldown",
        str(COOLDOWN),
        "--window",
        str(WINDOW),
        "--tolerance",
        str(TOLERANCE),
    )
    assert res["policy"]["mode"] == "advisory", res
    base = _load(dep, RATE, 16)
    time.sleep(WINDOW + 3)  # the window holds the base load alone
    # The queue is the ranks' time-weighted mean (their request-seconds counters), so even a light
    # load's short requests show; the wait covers a load process slow to start on a busy box.
    quiet = wait_for(
        lambda: (qs := [q for d in _decisions(dep.name)[-3:] if (q := _queue(d)) is not None]) and min(qs) > 0 and qs,
        timeout=20,
        interval=1.0,
        what="the base load's queue",
    )
    # The base load's queue per rank sits at half the target from here: the band (TOLERANCE) is
    # then 0.4x..3.6x of it, room for the +30 % wander (which, on 2 shared cores, the extra load
    # process's own CPU turned into 2.5x the queue in one CI run: the base is a few queued requests,
    # so its mean is coarse), while a 4x step overloads the ranks and lands far above it.
    target = round(2.0 * sum(quiet) / len(quiet), 3)
    step = _load(dep, 3 * RATE, 6)
    advised = wait_for(
        lambda: [
            d
            for d in _decisions(dep.name)
            if d["recommendation"] > d["current_dp"] and d["action"] == "advisory: not acted"
        ],
        timeout=30,
        interval=0.5,
        what="an advisory recommendation to scale up",
    )
    shown = _status(dep.name)
    assert shown is not None and "autoscale" in shown["info"], shown
    text = eepctl("status", "--name", dep.name)
    assert "autoscale: mode advisory" in text.stdout and "autoscale recommends DP" in text.stdout, text.stdout
    trail = eepctl("events", "--name", dep.name, "--autoscaler")
    assert advised[0]["id"] in trail.stdout and "advisory: not acted" in trail.stdout, trail.stdout[-2000:]
    finish_load(step, cfg_d, TOKENS, stop=True)
    finish_load(base, cfg_d, TOKENS, stop=True)
    assert len(_ops(dep.name)) == ops_before, "advisory mode acted"

    # 3. Mode on, the load wandering inside the band (base, then base + 30 %): nothing moves.
    base = _load(dep, RATE, 15)
    time.sleep(WINDOW + 2)  # the window holds this load alone (not the step's queue draining)
    t_on = time.time()
    eepctl_json("autoscale", "--name", dep.name, "--mode", "on", "--target-queue", str(target))
    wander = _load(dep, 0.3 * RATE, 5)
    finish_load(wander, cfg_d, TOKENS)
    finish_load(base, cfg_d, TOKENS)
    band = [d for d in _decisions(dep.name) if d["at"] >= t_on and d["mode"] == "on"]
    seen = [(round(d["at"] - t_on, 1), _queue(d), d["raw_recommendation"], d["action"]) for d in band]
    assert len(_ops(dep.name)) == ops_before, (target, seen)
    assert band and not _acted(band), (target, seen)
    queue = [q for _, q, _, _ in seen if q is not None]
    assert max(queue) >= 1.2 * min(queue), f"the load did not wander: {seen}"

    # 4. Mode on, a 4x step, and a member SIGKILLed as it begins: while the recovery runs (held
    # in its regroup for HOLD_S, longer than the signal takes to cross the band plus the
    # up-delay), no decision is acted on; after it, the autoscaler scales the survivor up.
    victim = int(next(r for r in _serving(dep.name, [0, 2])["ranks"] if r["rank"] == 2)["pid"])
    # The load rule at 1 % of a rank's capacity: the step's arrivals need far more than DP 3 on any
    # machine; max step 1 would bound any other rule to 1 -> 2. Set through the controller's own
    # method (what `eepctl autoscale` calls): a CLI process's seconds here would let the queue's
    # down-delay, running since the band's load ended, remove the rank about to be killed.
    _set_policy(dep.name, {"target_utilization": 0.01, "max_step": 1})
    step = _load(dep, 4 * RATE, 25)
    time.sleep(1.0)  # requests in flight; the signal has not crossed the band plus the up-delay yet
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)  # the rank actor's process of this test's own deployment
    rec = wait_for(
        lambda: [o for o in _ops(dep.name) if o["kind"] == "recover" and o.get("finished")],
        timeout=90,
        interval=0.5,
        what="the recovery of the killed rank",
    )[0]
    assert rec["state"] == "succeeded" and rec["dead_ranks"] == [2], rec
    assert rec["finished"] - t_kill >= HOLD_S, "the recovery was not held: it proves nothing about gating"
    up = wait_for(
        lambda: [
            o for o in _ops(dep.name) if o["kind"] == "scale" and o["started"] >= rec["finished"] and o.get("finished")
        ],
        timeout=90,
        interval=0.5,
        what="the autoscaler's scale-up",
    )[0]
    # One jump to the width the load needs (bounded by --max-dp 3), past --max-step 1.
    assert (up["from_size"], up["to_size"], up["state"]) == (1, 3, "succeeded"), (up.get("error"), up)
    trail = _decisions(dep.name)
    jump = next(d for d in _acted(trail) if d["at"] >= rec["finished"])
    load = next(s for s in jump["signals"] if s["name"] == "load")
    assert jump["rule"].startswith("load held up") and "load: ceil((" in jump["rule"], jump["rule"]
    assert load["terms"]["arrival_rps"] > 0 and load["recommendation"] > 3, load
    during = [d for d in trail if t_kill <= d["at"] <= rec["finished"]]
    assert not _acted(during), [(d["at"], d["action"]) for d in _acted(during)]
    assert all(d["action"].startswith(("blocked", "none")) for d in during), [d["action"] for d in during]
    transition_s = up["finished"] - up["started"]
    held_up, late_s = _up_timing(trail, rec, up)
    # The up-delay is a stabilisation window over the recommendations (HPA's): asks made while the
    # recovery blocked every action count, so the up may start as soon as the recovery ends, but
    # never before the asks were held for the up-delay, and not later than one tick or two after.
    assert held_up >= UP_DELAY - 0.5, f"up acted on asks held {held_up:.1f}s of a {UP_DELAY}s up-delay"
    assert late_s <= 2.5, f"up started {late_s:.1f}s after the up-delay and the recovery had both passed"
    finish_load(step, cfg_d, TOKENS, stop=True)
    ups = _settled_ups(dep.name, rec)
    assert ups[0]["op_id"] == up["op_id"], ups
    eepctl_json("autoscale", "--name", dep.name, "--max-step", "2")  # the way down in one decision, as before
    grown = list(range(ups[-1]["to_size"]))

    # 5. Load gone: down only after the down-delay, the ranks with the least work leaving. The down is
    # looked for from the last up's end, not from when this test looks: on a loaded box the load's
    # tail and the eepctl calls above can take most of the 25 s down-delay (two CI runs saw the down
    # done before status was read here).
    down = wait_for(
        lambda: [
            o
            for o in _ops(dep.name)
            if o["kind"] == "scale"
            and o["to_size"] < o["from_size"]
            and o["started"] >= ups[-1]["finished"]
            and o.get("finished")
        ],
        timeout=90,
        interval=0.5,
        what="the autoscaler's scale-down",
    )[0]
    assert (down["from_size"], down["to_size"], down["state"]) == (len(grown), 1, "succeeded"), down
    trail = _decisions(dep.name)
    acted = [d for d in _acted(trail) if d["at"] >= ups[-1]["finished"]]
    assert acted and acted[0]["recommendation"] == 1, acted
    run = []  # the unbroken run of down recommendations that ended in the act
    for d in reversed([d for d in trail if ups[-1]["finished"] <= d["at"] <= acted[0]["at"]]):
        if d["raw_recommendation"] >= d["current_dp"]:
            break
        run.append(d)
    held = acted[0]["at"] - run[-1]["at"]
    assert held >= DOWN_DELAY - 1.0, f"down after {held:.1f}s of a {DOWN_DELAY}s down-delay"
    leaving = down["plan"]["leaving"]
    assert [(j["rank"], j["chosen_by"], j["requests"]) for j in leaving] == [(r, "least work", 0) for r in grown[1:]]
    final = _serving(dep.name, [0])
    assert len(_acted(_decisions(dep.name))) == len(ups) + 1, "up after the recovery, down: nothing else"
    assert final["info"]["autoscale"]["policy"]["mode"] == "on"
    eepctl_json("autoscale", "--name", dep.name, "--mode", "advisory")  # the last requests must not scale up
    gen = eepctl_json("generate", "--name", dep.name, "--max-tokens", str(TOKENS), timeout=90)
    assert all(not r["error"] for r in gen["results"]), gen
    idle = _idle_cpu(dep.name, final, 5.0)  # the loop's cost with a policy deciding every tick (printed)
    print(
        f"autoscale e2e: target queue {target:.2f}/rank; recovery {rec['finished'] - t_kill:.1f}s after the kill "
        f"(held {HOLD_S:g}s); up {up['finished'] - rec['finished']:.1f}s after it (asks held {held_up:.1f}s, "
        f"started {late_s:+.1f}s after delay and recovery, transition {transition_s:.1f}s; ups "
        f"{[(o['from_size'], o['to_size']) for o in ups]}); "
        f"down {held:.1f}s after it was first asked in a row; scenario {time.time() - t_ready:.0f}s, "
        f"with up {time.time() - t0:.0f}s; idle with a policy: {idle}"
    )
