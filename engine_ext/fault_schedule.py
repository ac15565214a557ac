"""Seeded schedules of scales with one fault each, for chaos runs against a deployment (the chaos
test, tests/test_chaos_ray.py, and the longer benchmarks/chaos.py share them). Plain data: what
to scale to, which fault, when and whom; running it is the runner's (tests/chaos.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass

# rank-kill: a rank SIGKILLed; rank-stop: a rank SIGSTOPped, resumed two health deadlines later;
# controller-kill: the controller actor SIGKILLed (Ray restarts it; it takes the deployment over);
# rank+controller: a rank and the controller SIGKILLed together.
FAULTS = ("rank-kill", "rank-stop", "controller-kill", "rank+controller")


@dataclass(frozen=True)
class Round:
    """One scale and its fault, ``at_s`` seconds after the scale starts. ``victim`` in [0, 1) picks
    the rank among those listed when the fault fires (sorted); ``members_only``: among the members
    at the scale's start."""

    target: int
    fault: str
    at_s: float
    victim: float = 0.0
    members_only: bool = False


# Take-overs under faults, from DP 2: 2 -> 4 with rank 1 and the controller killed 1 s in, 1 -> 3
# with its only member killed 1.7 s in, back to 2, then 2 -> 1 with rank 0 and the controller killed
# 0.9 s in. Each restarted controller must remove what the interrupted attempt reserved (its
# placement groups), or every later launch fails on their names.
TAKEOVERS = [
    Round(4, "rank+controller", 1.0, 0.75, True),
    Round(3, "rank-kill", 1.7, 0.0, True),
    Round(2, "rank-kill", 2.0, 0.0, False),
    Round(1, "rank+controller", 0.9, 0.0, True),
]


def schedule(seed: int, rounds: int, start_dp: int, max_dp: int) -> list[Round]:
    """``rounds`` random rounds: each target differs from the one before; fault, moment (0.3-3 s)
    and victim drawn from ``seed``."""
    rng = random.Random(seed)
    out, last = [], start_dp
    for _ in range(rounds):
        target = rng.choice([n for n in range(1, max_dp + 1) if n != last])
        out.append(Round(target, rng.choice(FAULTS), round(rng.uniform(0.3, 3.0), 2), round(rng.random(), 3)))
        last = target
    return out
