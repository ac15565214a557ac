"""Mixed faults on a real local Ray cluster: a schedule of scales, each with one fault a moment in
(a rank SIGKILLed, a rank SIGSTOPped and resumed, the controller SIGKILLed, a rank and the
controller together), under open-loop load. After every round the deployment serves its desired
size within a bound with the oracle's outputs; at the end no request failed.

The schedule is engine_ext.fault_schedule.TAKEOVERS (each restarted controller must remove what
the interrupted attempt reserved, or every later launch fails on its names) followed by two seeded
random rounds; the seed is printed, and ``EEP_CHAOS_SEED`` replays one. benchmarks/chaos.py runs
longer schedules with the same runner (tests/chaos.py).
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict

import pytest

from engine_ext.fault_schedule import TAKEOVERS, schedule
from tests.chaos import DEADLINE_S, ENGINE, MAX_DP, START_DP, Chaos
from tests.helpers import NAMESPACE, events, finish_load, oracle, wait_serving_load

pytestmark = pytest.mark.ray


@pytest.mark.timeout(420)
def test_mixed_faults_during_scales_never_wedge(deployments, ray_cluster):
    import ray
    from eepctl import core

    seed = int(os.environ.get("EEP_CHAOS_SEED") or random.randrange(10**6))
    rounds = TAKEOVERS + schedule(seed, 2, TAKEOVERS[-1].target, MAX_DP)
    print(f"\n[chaos] seed {seed} (EEP_CHAOS_SEED={seed} replays it): {[asdict(r) for r in rounds]}")
    d = deployments("chaos")
    t = core.Target(name=d.name, namespace=NAMESPACE)
    if ray.is_initialized():
        ray.shutdown()
    snap = core.up(
        t,
        dp=START_DP,
        max_dp=MAX_DP,
        engine=ENGINE,
        cpus_per_rank=1.0,
        gpus_per_rank=0.0,
        timeout_s=300,
        health_deadline_s=DEADLINE_S,
    )
    cfg_d = dict(ENGINE, instance_id=d.name)
    load = d.popen("generate", "--name", d.name, "--rate", "2", "--duration", "900", "--timeout", "300", "-o", "json")
    wait_serving_load(d.name)
    chaos = Chaos(core, t, lambda p: oracle(cfg_d, p), bound_s=150.0, log=lambda s: print(f"[chaos] {s}"))
    try:
        records = [chaos.run_round(i, rnd) for i, rnd in enumerate(rounds)]
    finally:
        chaos.close()
    res = finish_load(load, cfg_d, stop=True)  # no request failed; every output is the oracle's
    ops = events(d.name)["operations"]
    print(
        f"[chaos] {len(records)} rounds, serving again after {[r['serving_s'] for r in records]} s; "
        f"{res['sent']} requests, 0 failed; operations {[(o.get('kind'), o.get('state')) for o in ops]}"
    )
    assert snap["dp"] == START_DP
