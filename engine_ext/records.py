"""The typed records ranks report, the registry stores and eepctl renders (docs/status-schema.md).

msgspec Structs: one library checks types, ranges and unknown keys where records enter the
registry (``from_builtins``) and turns them back into JSON-ready builtins (``to_builtins``).
msgspec is a small C extension: eepctl imports this module on every command, so it must never
pull in torch or ray.
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec

# Rejects NaN and +-inf, which JSON cannot carry and which would poison sums and maxima.
FiniteFloat = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
Record = TypeVar("Record", bound=msgspec.Struct)


class RankState(str, enum.Enum):
    STARTING = "starting"
    STANDBY = "standby"  # launched ahead in the standby pool: in no DP group, serving nothing
    SERVING = "serving"
    PREPARING = "preparing"
    COMMITTING = "committing"
    WARMING = "warming"
    CAPTURING = "capturing"
    DRAINING = "draining"
    REMOVING = "removing"
    REMOVED = "removed"
    FAILED = "failed"
    STALE = "stale"
    DEGRADED = "degraded"  # a peer died: groups aborted, weights/KV/requests kept, not stepping
    RECOVERING = "recovering"  # rebuilding the world without the dead ranks
    DEAD = "dead"  # the process is gone (recorded by the controller, with its cause)
    FENCED = "fenced"  # excluded from the world by epoch (it hung, failed or was cut off): it serves nothing


class Refusal(str, enum.Enum):
    """Why a rank refuses a request (``RankRefused.code``); the router parks or fails on it (at
    once for ``INVALID``: the client's input, not the world, is what cannot serve)."""

    DEGRADED = "degraded"  # a peer died: a recovery follows and resumes the rank
    RECOVERING = "recovering"  # the rank is rebuilding the world without the dead ranks
    REMOVING = "removing"  # committing its removal in a scale-down
    REMOVED = "removed"  # left the deployment
    FAILED = "failed"  # broken: it takes nothing until replaced
    STOPPED = "stopped"  # shutting down
    FENCED = "fenced"  # excluded from the world by epoch: it never serves again
    INVALID = "invalid"  # the request exceeds the model's limits: no rank ever takes it (final)

    @property
    def recovery_coming(self) -> bool:
        """A recovery that is under way (or follows) resumes the rank: park, do not fail."""
        return self in (Refusal.DEGRADED, Refusal.RECOVERING)


class Phase(str, enum.Enum):
    """Transition phases; the same words for the reference engine and for vLLM."""

    PLAN = "plan"
    LAUNCH = "launch"
    PREPARE = "prepare"
    TRANSFER = "transfer"
    DRAIN = "drain"
    COMMIT = "commit"
    RESHUFFLE = "reshuffle"
    WARM = "warm"
    CAPTURE = "capture"
    CLEANUP = "cleanup"
    ROLLBACK = "rollback"
    # Recovery (an operation of kind "recover"): detect, abort, regroup, restore_experts, warm, capture, resume.
    DETECT = "detect"
    ABORT = "abort"
    REGROUP = "regroup"
    RESTORE_EXPERTS = "restore_experts"
    RESUME = "resume"


# Phases whose per-operation durations `eepctl events` reports, in protocol order.
REPORTED_PHASES = ("launch", "prepare", "transfer", "precopy", "drain", "commit", "reshuffle", "warm", "capture")


class OpState(str, enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


class DeploymentKind(str, enum.Enum):
    REFERENCE = "reference"
    VLLM = "vllm"


class RankStatus(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One rank as the registry sees it (DESIGN section 6). Unknown keys are refused: a field a
    rank sends is declared here (or in VllmRankStatus), so a typo cannot pass as data."""

    deployment: str
    rank: Annotated[int, msgspec.Meta(ge=0)]
    instance_id: str
    engine_id: str
    kind: str = DeploymentKind.REFERENCE.value
    node: str = ""
    node_id: str = ""  # the Ray node id (empty under the process launcher)
    node_ip: str = ""  # the address this rank's store and gloo device use
    pid: int = 0
    device: str = "cpu"
    device_uuid: str = ""  # the physical GPU (ranks sharing one report the same); "" on CPU
    mps: bool | None = None  # an MPS control daemon is up for this rank's GPU; None on CPU
    state: str = RankState.STARTING.value
    state_reason: str = ""
    dp_size: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    request_seconds: float | None = None  # requests held integrated over time (RequestSeconds), at last_heartbeat
    slots_used: int = 0
    slots_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    workspace_bytes: int = 0
    move_bytes_held: int = 0  # a scale's expert pre-copy: spare buffers held until its commit (out of the KV pool)
    workspace_locked: bool = False
    workspace_required_bytes: int = 0
    capture_policy: str = "recapture"  # "reuse": workspace and captures sized for max DP at start
    workspace_recapture_bytes: int = 0  # what "recapture" would hold at this world (reuse's cost)
    graphs_captured: int = 0
    capture_sizes: list[int] = []
    graph_kind: str = "cpu-static"  # "cuda" where CUDA graphs apply
    graph_replays: int = 0
    last_capture_s: FiniteFloat | None = None
    capture_times_s: dict[str, FiniteFloat] = {}  # per captured size (as a string): its last capture's seconds
    last_capture_pass_s: FiniteFloat | None = None  # the last capture pass, all sizes
    captures_this_op: int = 0
    current_op: str = ""
    eplb_step: int = 0
    eplb_imbalance: FiniteFloat = 0.0  # max/mean rank load: 1.0 is balanced, 0.0 before any load
    physical_experts: int = 0
    logical_experts: int = 0
    steps: int = 0
    last_heartbeat: FiniteFloat = 0.0
    heartbeat_age_s: FiniteFloat = 0.0  # set by the registry's views
    stale_replays_refused: int = 0  # I3
    epoch: int = 0  # the world (rendezvous) the rank serves in; a fenced rank's older epoch is ignored
    # The per-step collectives' transport of the rank's live group ("shm": shared memory among the
    # ranks of one host; "cuda_ipc": device buffers mapped through CUDA IPC among the GPU ranks of
    # one host; "gloo"; "" before a group), and how many ranks it saw map its buffers.
    transport: str = ""
    transport_attached: int = 0
    # Since the rank switched to its current world (``switch_op``'s): replays and eager fallbacks
    # (no capture for the size) per batch size (as a string), and the operation each capture was made in.
    switch_op: str = ""
    replays_since_switch: dict[str, int] = {}
    eager_since_switch: dict[str, int] = {}
    eager_fallbacks: int = 0  # since start-up
    capture_sizes_expected: list[int] = []  # the sizes the config captures
    captured_in: dict[str, str] = {}
    eplb_logical_load: list[FiniteFloat] = []
    # The tokens this rank routed to each logical expert over its last EPLB window of steps, and
    # the logical expert each of its physical slots holds: the registry computes the
    # deployment's balance from these raw counts (registry_state.eplb_balance).
    eplb_recent_load: list[FiniteFloat] = []
    eplb_slots: list[int] = []
    # Per-request latency measured by this rank over its last ``latency_window_s`` seconds
    # (engine_ext/rank/latency.py): the autoscaler's SLO signals. None: no request finished.
    ttft_ms_p50: FiniteFloat | None = None
    ttft_ms_p95: FiniteFloat | None = None
    tpot_ms_p50: FiniteFloat | None = None
    tpot_ms_p95: FiniteFloat | None = None
    latency_samples: int = 0
    latency_window_s: FiniteFloat = 0.0
    # The autoscaler's load signals (engine_ext/rank/latency.py ``ServedTokens``): tokens served
    # (prompt and output), the tokens and seconds of the steps taken while requests waited (their
    # ratio: the rank's capacity at saturation), and the work held, in tokens (None: not known).
    tokens_served: int = 0
    saturated_tokens: int = 0
    saturated_s: FiniteFloat = 0.0
    tokens_queued: int | None = None
    # Memory: the rank's process resident set (VmRSS; a vLLM rank's engine-core process), what the
    # rank's processes hold together (a vLLM rank: its engine core and, in a process of its own, its
    # worker), and its KV cache's bytes where the engine says them. None: not reported.
    rss_bytes: int | None = None
    memory_bytes: int | None = None
    kv_cache_bytes: int | None = None


class VllmRankStatus(RankStatus, kw_only=True, forbid_unknown_fields=True):
    """A vLLM rank (kind "vllm"): every RankStatus field and what the engine_ext plugin reads besides."""

    kind: str = DeploymentKind.VLLM.value
    kv_usage: FiniteFloat = 0.0
    workspace_available: bool = False
    workspace_note: str = ""
    last_op: str = ""
    op_phase_s: dict[str, FiniteFloat] = {}
    captures_total: int = 0
    hook_calls: dict[str, dict[str, int | FiniteFloat]] = {}
    hooks: dict[str, str] = {}
    worker_pid: int = 0
    dp_backend: str = ""
    elastic_ep: bool = False
    # From the rank's worker record (VllmWorkerStatus), merged by the registry; "" / None before one.
    started: FiniteFloat = 0.0  # when the plugin started in the engine-core process
    worker_executor: str = ""  # what started the worker: "uni", "mp" or "ray"
    worker_age_s: FiniteFloat | None = None  # seconds since the worker's last report
    warmups_total: int = 0
    warmups_this_op: int = 0
    last_warmup_s: FiniteFloat | None = None
    worker_rss_bytes: int | None = None  # the worker's process resident set (its record's rss_bytes)


class VllmWorkerStatus(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a vLLM worker (the driver worker of a DP rank, TP rank 0) reports itself, from its own
    process under any executor; the registry merges it into its rank's VllmRankStatus
    (engine_ext.control.worker_records), the worker's fields winning for workspace and captures."""

    deployment: str
    rank: Annotated[int, msgspec.Meta(ge=0)]  # DP rank, read live from the worker's config
    dp_size: int = 0
    executor: str = ""
    pid: int = 0
    node: str = ""
    device: str = ""
    started: FiniteFloat = 0.0  # when the plugin started in the worker's process
    last_heartbeat: FiniteFloat = 0.0
    state: str = ""  # the rank state while a wrapped step runs; "" between steps
    workspace_available: bool = False
    workspace_bytes: int = 0
    workspace_locked: bool = False
    workspace_note: str = ""
    graph_kind: str = "none"
    graphs_captured: int = 0
    capture_sizes: list[int] = []  # the sizes the live capture pass captured (measured)
    capture_sizes_expected: list[int] = []  # the sizes the config captures
    capture_times_s: dict[str, FiniteFloat] = {}  # the last capture pass: seconds per size
    last_capture_pass_s: FiniteFloat | None = None
    captures_total: int = 0
    captures_this_op: int = 0
    warmups_total: int = 0
    warmups_this_op: int = 0
    last_warmup_s: FiniteFloat | None = None
    current_op: str = ""
    last_op: str = ""
    op_phase_s: dict[str, FiniteFloat] = {}
    hook_calls: dict[str, dict[str, int | FiniteFloat]] = {}
    hooks: dict[str, str] = {}
    rss_bytes: int | None = None  # the worker's process resident set (VmRSS)


def rank_status_type(kind: Any) -> type[RankStatus]:
    """The record a rank of this deployment kind reports."""
    return VllmRankStatus if kind == DeploymentKind.VLLM.value else RankStatus


class Event(msgspec.Struct, forbid_unknown_fields=True):
    """One phase of one operation on one rank (rank -1: the controller)."""

    op_id: str
    rank: Annotated[int, msgspec.Meta(ge=-1)]
    phase: str
    start: FiniteFloat
    end: FiniteFloat
    outcome: str = "ok"
    detail: dict[str, Any] = {}
    duration_s: float = 0.0  # computed from start and end; a sent value is ignored

    def __post_init__(self) -> None:
        self.duration_s = round(max(0.0, float(self.end - self.start)), 6)


class Operation(msgspec.Struct, forbid_unknown_fields=True):
    """A scale operation as recorded by the registry."""

    op_id: str
    deployment: str
    from_size: int
    to_size: int
    state: str = OpState.RUNNING.value
    phase: str = Phase.PLAN.value
    started: FiniteFloat = msgspec.field(default_factory=time.time)
    finished: FiniteFloat | None = None
    error: str = ""
    error_code: int = 0
    phase_durations: dict[str, FiniteFloat] = {}
    serving_pause_s: FiniteFloat = 0.0
    captures_per_rank: dict[str, int] = {}
    workspace_before: dict[str, int] = {}
    workspace_after: dict[str, int] = {}
    rank_states: dict[str, str] = {}
    plan: dict[str, Any] = {}
    # Only a vLLM operation (driven from outside the ranks) has these; absent from the JSON otherwise.
    deadline: FiniteFloat | msgspec.UnsetType = msgspec.UNSET  # after it, a still-running op is stale
    rank_ops: list[str] | msgspec.UnsetType = msgspec.UNSET  # the op ids vLLM's ranks used
    warmups_per_rank: dict[str, int] | msgspec.UnsetType = msgspec.UNSET  # vLLM: worker warm-up passes
    kind: str = "scale"  # "scale" | "recover" (a death turned into a transition) | "rebuild" (nothing left)
    # scale: why the controller started it ("" when an operator asked): "replace" (growing back
    # to the desired size after a death) or "autoscale"
    cause: str = ""
    dead_ranks: list[int] = []  # recover: the global ranks that died
    rerouted_requests: int = 0  # recover: requests of dead ranks re-submitted to survivors
    # scale-up: requests waiting on the old ranks given back after the commit and re-dispatched
    # (engine_ext.control.redispatch), so the joiners take their share of the backlog
    redispatched_requests: int = 0
    # scale: by rank, the spare bytes its expert pre-copy held, for how long, when and why they were freed
    move_memory: dict[str, dict[str, Any]] = {}
    # scale: the plan's predicted cost beside what the scale measured (engine_ext.control.cost_model)
    cost: dict[str, Any] = {}


def to_builtins(record: Any) -> Any:
    """A record (or a structure of them) as JSON-ready dicts, lists and scalars. A value msgspec
    cannot encode inside a free-form part (an event's ``detail``) becomes its ``str``: a rank's
    diagnostics must never fail the phase they describe."""
    return msgspec.to_builtins(record, enc_hook=str)


_NULL_MEANS_DEFAULT: dict[type, frozenset[str]] = {}


def _null_means_default(record_type: type) -> frozenset[str]:
    """Fields with a default that cannot hold None: a None sent for them means the default."""
    names = _NULL_MEANS_DEFAULT.get(record_type)
    if names is None:
        names = frozenset(
            f.name for f in msgspec.structs.fields(record_type) if not f.required and not _accepts_none(f.type)
        )
        _NULL_MEANS_DEFAULT[record_type] = names
    return names


def _accepts_none(tp: Any) -> bool:
    return tp is None or tp is type(None) or type(None) in getattr(tp, "__args__", ())


def from_builtins(data: Any, record_type: type[Record], what: str | None = None) -> Record:
    """The typed record from JSON-like data, checked strictly (no "1" for 1, no 2.0 for 2, no
    NaN, no unknown keys). Refused data raises ValueError with msgspec's message."""
    if isinstance(data, Mapping):
        nulls = _null_means_default(record_type)
        data = {
            k: v.value if isinstance(v, enum.Enum) else v  # RankState.SERVING is "serving"
            for k, v in data.items()
            if v is not None or k not in nulls
        }
    try:
        return msgspec.convert(data, record_type, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(f"{what or record_type.__name__}: {e}") from None
