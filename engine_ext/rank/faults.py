"""Deliberate faults, the one seam through which tests break a rank on purpose.

``EngineConfig.faults`` names them; production code asks a ``Faults`` object
(``faults.active("skip_release")``, ``faults.hold("prepare")``) and never reads the list itself.
Each broken variant reproduces one upstream bug so a test can show the matching invariant
check catches it. A variant switches a production mechanism off (or reorders it), so the harm
it shows comes from the missing mechanism; two still build their broken state by hand, because
no production path applies the suffix twice (``double_suffix``) or rewrites live slots' block
tables (``warmup_not_isolated``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Broken variants: name -> what it breaks (and which invariant check must catch it).
VARIANTS: dict[str, str] = {
    "double_suffix": "identities are suffixed twice, `<id>_dp<r>_dp<r>` (the upstream bug, built by hand; I1)",
    "no_suffix": "identities are not suffixed: every rank claims the same instance and engine id (I1)",
    "skip_release": "release and re-capture are switched off in a transition: the old captures stay, "
                    "so replays would read the old world's buffers (I3; and 0 capture passes, I4)",
    "no_stale_check": "the replay staleness check is off: a stale capture replays (shows I3's harm)",
    "skip_rewarm": "the workspace is not right-sized for the new world in a transition: the lock "
                   "refuses it, too small on a scale-up, too large on a scale-down (I4)",
    "no_lock_check": "the workspace locks at whatever size it holds (shows skip_rewarm's harm)",
    "double_capture": "two capture passes per transition (upstream before its fix; I4)",
    "warmup_not_isolated": "the warm-up batch takes every request slot, live ones included, pointing "
                           "their block tables at live KV blocks that it then writes (I5)",
    "eplb_not_suppressed": "the warm-up batch's routing is recorded as EPLB load (I5)",
    "no_warmup_check": "warm-up isolation is measured and reported but not enforced (shows I5's harm)",
    "late_eplb_comm": "prepare runs its steps in reverse: the non-expert weight transfer before the "
                      "groups and the EPLB communicator, so it has no channel and joining ranks serve "
                      "with placeholder weights (I2)",
    "reuse_sized_for_world": "under capture_policy=reuse, captures are sized for the world at launch "
                             "instead of max DP: the reuse check refuses them on a scale-up",
    "no_token_stream": "the rank does not stream its tokens to the router: a request moved off a dead "
                       "rank re-prefills from its prompt only (resumed_with 0; greedy outputs hide it)",
    "reuse_drops_captures": "under capture_policy=reuse, survivors release their captures in a transition "
                            "instead of keeping them: they serve decodes eagerly (outputs unchanged; the "
                            "eager-fallback counter and the registry show it)",
    "slow_prepare": "alias of a hold in prepare on joining ranks only: a window to kill a joiner",
}

# Phases a rank can be held in with "hold:<phase>" or "hold:<phase>@<rank>".
# "step" holds once per process, at the first step where a request it serves already has output
# tokens: a window to kill a rank that certainly holds requests with tokens to continue with.
HOLD_PHASES = ("launch", "prepare", "transfer", "drain", "commit", "reshuffle", "warm", "capture", "step")
ONCE_PHASES = frozenset({"step"})


class Faults:
    """The faults configured for one rank."""

    def __init__(self, names: list[str], delay_s: float, rank: int,
                 on_hold: Callable[[str], None] | None = None) -> None:
        unknown = [n for n in names if n not in VARIANTS and not _is_hold(n)]
        if unknown:
            raise ValueError(f"unknown fault(s) {unknown}; known: {sorted(VARIANTS)} and "
                             f"hold:<phase>[@<rank>] with phase in {HOLD_PHASES}")
        self.names = frozenset(names)
        self.delay_s = delay_s
        self.rank = rank
        self.on_hold = on_hold or (lambda phase: None)
        self.held: set[str] = set()  # phases of ONCE_PHASES already held

    def active(self, variant: str) -> bool:
        """Whether the broken variant ``variant`` is configured."""
        if variant not in VARIANTS:
            raise KeyError(f"no fault variant {variant!r}")
        return variant in self.names

    def holds(self, phase: str, *, joining: bool = False) -> bool:
        if f"hold:{phase}" in self.names or f"hold:{phase}@{self.rank}" in self.names:
            return True
        return phase == "prepare" and joining and "slow_prepare" in self.names

    def hold(self, phase: str, *, joining: bool = False) -> bool:
        """Wait ``fault_delay_s`` at the start of ``phase`` when a hold names it, so a test can
        kill the rank there. Returns whether it held."""
        if phase not in HOLD_PHASES:
            raise KeyError(f"no hold phase {phase!r}")
        if not self.holds(phase, joining=joining) or phase in self.held:
            return False
        if phase in ONCE_PHASES:
            self.held.add(phase)
        self.on_hold(phase)
        time.sleep(self.delay_s)
        return True


def _is_hold(name: str) -> bool:
    if not name.startswith("hold:"):
        return False
    phase, _, rank = name[len("hold:"):].partition("@")
    return phase in HOLD_PHASES and (not rank or rank.isdigit())
