"""Deliberate faults, the one seam through which tests break a rank or the controller on purpose.

``EngineConfig.faults`` names them; rank code asks a ``Faults`` object
(``faults.active("skip_release")``, ``faults.hold("prepare")``), controller code asks
``variant_on(cfg.faults, "no_reroute")``; neither reads the list itself. Torch-free, so both
sides import it.
Each broken variant reproduces one upstream bug so a test can show the matching invariant
check catches it. A variant switches a production mechanism off (or reorders it), so the harm
it shows comes from the missing mechanism; two still build their broken state by hand, because
no production path applies the suffix twice (``double_suffix``) or rewrites live slots' block
tables (``warmup_not_isolated``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# Test-only switches read from the environment: they live here, with the other deliberate faults,
# so that no production module reads a test's variable itself.
BACKOFF_MAX_ENV = "EEPCTL_TEST_BACKOFF_MAX_S"  # the controller's longest back-off (multi-node tests)
DEBUG_FAIL_COMMIT_ENV = "EEPCTL_VLLM_DEBUG_FAIL_COMMIT"  # a file: while it exists, vLLM scale commits fail


def backoff_max_s(default: float) -> float:
    """The controller's longest back-off between failed reconcile actions: ``default``, or what a
    test set in ``EEPCTL_TEST_BACKOFF_MAX_S`` (the multi-node tests bring capacity back seconds after
    a loss and must not wait out the escalated default)."""
    return float(os.environ.get(BACKOFF_MAX_ENV) or default)


def debug_fail_commit_file() -> str:
    """The file whose existence makes a vLLM server's scale commits fail (a test hook; "" when unset)."""
    return os.environ.get(DEBUG_FAIL_COMMIT_ENV, "")


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
    "groups and the EPLB communicator, so the transfer finds no channel and the scale "
    "fails (I2)",
    "transport_sized_for_old_world": "at a transition the new world's shared memory is sized for the old "
    "world's exchanges: on a scale-up the I2 transport check refuses it in "
    "prepare (the scale rolls back, nothing moved)",
    "no_transport_check": "prepare does not check the new world's transport from its evidence (shows "
    "transport_sized_for_old_world's harm: the new world runs on a segment its largest "
    "routed exchange overflows, which fails the step on every member)",
    "reuse_sized_for_world": "under capture_policy=reuse, captures are sized for the world at launch "
    "instead of max DP: the reuse check refuses them on a scale-up",
    "no_token_stream": "the rank does not stream its tokens to the router: a request moved off a dead "
    "rank re-prefills from its prompt only (resumed_with 0; greedy outputs hide it)",
    "reuse_drops_captures": "under capture_policy=reuse, survivors release their captures in a transition "
    "instead of keeping them: they serve decodes eagerly (outputs unchanged; the "
    "eager-fallback counter and the registry show it)",
    "precopy_into_live_slots": "a member receives a scale's pre-copied experts straight into the slots it "
    "serves from instead of spare buffers: the old world serves them before the "
    "switch, and a failure before the switch leaves them moved (wrong tokens)",
    "slow_prepare": "alias of a hold in prepare on joining ranks only: a window to kill a joiner",
    # Self-healing mechanisms switched off: the harm shows when a rank dies.
    "no_reroute": "the controller does not re-route a dead rank's requests (router park/re-route): "
    "they stay owned by the dead rank and are never answered",
    "no_degrade": "a survivor takes a peer's death for its own failure (degrade-vs-fail classification "
    "off): it reports `failed` instead of `degraded`, so status shows a healthy rank broken, "
    "and the reconcile loop fences it if it sees that report before the recovery reaches it "
    "(a healthy rank lost; its requests move, none fails)",
    "no_store_rehost": "a recovery does not re-host the store when its host died: the survivors "
    "regroup on the dead store and the recovery fails",
    "no_group_abort": "a degrading or recovering rank does not abort its groups: a thread blocked in a "
    "collective with a survivor that stopped waits out the backend's timeout",
    "no_sleeper_abandon": "a recovery waits for a step thread asleep on the store instead of leaving it "
    "behind: with the store's host cut off that wait does not return, and the "
    'recovery fails ("the step loop did not stop")',
    "no_weight_source_restore": "a recovery does not load experts whose every copy died from the weight "
    "source: their slots keep another expert's weights (wrong tokens)",
}

# Phases a rank can be held in with "hold:<phase>" or "hold:<phase>@<rank>" (``adopt``: a standby taken
# from the pool, after it got its DP rank; ``regroup``: a survivor at the start of a recovery's regroup;
# ``admit``: the controller, not a rank, for ``fault_delay_s`` inside a scale's admission, after its
# request id was taken: a window for a retry with the same id).
# ``precopy`` holds a rank after its first exchange of a scale's pre-copy when it has more (mid pre-copy;
# ``move_batch_bytes=0`` makes every move an exchange).
# ``shm_setup`` holds a rank inside the set-up of a prepare's new DP group on shared memory, once it has
# mapped the segment and before it counts as attached: a window to kill a peer in group set-up.
# ``warm`` and ``capture`` hold in a transition or a recovery, not in the deployment's start-up.
# ``give_back`` holds a rank after it took its waiting requests out for a scale-up's re-dispatch and
# before it answers: the window where the caller's answer comes late.
# "step" holds once per process, at the first step where a request it serves already has output
# tokens: a window to kill a rank that certainly holds requests with tokens to continue with. Only a
# rank started with the deployment holds there: its replacement (a joiner) would otherwise stall its
# peers' steps past the step timeout and turn one kill into a cascade the test did not ask for.
HOLD_PHASES = (
    "admit",
    "launch",
    "adopt",
    "prepare",
    "shm_setup",
    "transfer",
    "precopy",
    "drain",
    "commit",
    "reshuffle",
    "warm",
    "capture",
    "regroup",
    "step",
    "give_back",
)
ONCE_PHASES = frozenset({"step"})
# Phases of a transition's commit, where forward passes are paused. A hold in one of them on a member
# that serves on in the new world (role "existing" or "remaining") makes that rank agree to commit
# only once it holds a running request with output tokens: a kill in the hold then finds requests
# mid-decode however fast steps are (the agreement waits for the request, not a timer).
PAUSED_PHASES = ("commit", "reshuffle", "warm", "capture")
# "fail:step@<rank>": that rank's step raises a local error (as an out-of-memory would) once, at its
# first step ``fault_delay_s`` after it started; the process stays alive. Only a rank started with
# the deployment fails (its replacement, a joiner, does not).
FAIL_PHASES = ("step",)


class Faults:
    """The faults configured for one rank."""

    def __init__(
        self,
        names: list[str],
        delay_s: float,
        rank: int,
        on_hold: Callable[[str], None] | None = None,
        joining: bool = False,
    ) -> None:
        unknown = [n for n in names if n not in VARIANTS and not _is_hold(n) and not _is_fail(n)]
        if unknown:
            raise ValueError(
                f"unknown fault(s) {unknown}; known: {sorted(VARIANTS)}, "
                f"hold:<phase>[@<rank>] with phase in {HOLD_PHASES} and fail:step@<rank>"
            )
        self.names = frozenset(names)
        self.delay_s = delay_s
        self.rank = rank
        self.on_hold = on_hold or (lambda phase: None)
        self.started = time.time()
        self.joining = joining
        self.failed: set[str] = set()
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

    def commit_waits_for_requests(self, role: str) -> bool:
        """Whether this rank, ``role`` in a transition, agrees to commit only while it holds a
        request with output tokens (a hold in PAUSED_PHASES names it; PAUSED_PHASES says why)."""
        return role in ("existing", "remaining") and any(self.holds(p) for p in PAUSED_PHASES)

    def fail_now(self, phase: str) -> bool:
        """Whether a "fail:<phase>@<rank>" fault makes this rank fail now (once)."""
        name = f"fail:{phase}@{self.rank}"
        if self.joining or name not in self.names or name in self.failed or time.time() - self.started < self.delay_s:
            return False
        self.failed.add(name)
        return True

    def hold(self, phase: str, *, joining: bool = False) -> bool:
        """Wait ``fault_delay_s`` at the start of ``phase`` when a hold names it, so a test can
        kill the rank there. Returns whether it held."""
        if phase not in HOLD_PHASES:
            raise KeyError(f"no hold phase {phase!r}")
        if not self.holds(phase, joining=joining) or phase in self.held or (phase in ONCE_PHASES and self.joining):
            return False
        if phase in ONCE_PHASES:
            self.held.add(phase)
        self.on_hold(phase)
        time.sleep(self.delay_s)
        return True


def _is_fail(name: str) -> bool:
    phase, _, rank = name[len("fail:") :].partition("@")
    return name.startswith("fail:") and phase in FAIL_PHASES and rank.isdigit()


def variant_on(names: list[str], variant: str) -> bool:
    """Whether the broken variant ``variant`` is among ``names`` (the controller side's check)."""
    if variant not in VARIANTS:
        raise KeyError(f"no fault variant {variant!r}")
    return variant in names


def controller_holds(names: list[str], phase: str) -> bool:
    """Whether "hold:<phase>" holds the controller in ``phase`` (``admit``)."""
    return f"hold:{phase}" in names


def _is_hold(name: str) -> bool:
    if not name.startswith("hold:"):
        return False
    phase, _, rank = name[len("hold:") :].partition("@")
    return phase in HOLD_PHASES and (not rank or rank.isdigit())
