"""Records shared by the engines, the in-cluster actors and eepctl.

Plain dataclasses and enums only: eepctl imports this module on every command, so it
must never pull in torch or ray.
"""

from __future__ import annotations

import enum
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEMA_VERSION = 1
DEFAULT_NAMESPACE = "eepctl"
DEFAULT_DEPLOYMENT = "moe"

# A rank is "stale" when its newest heartbeat is older than this.
STALE_AFTER_S = 4.0
HEARTBEAT_INTERVAL_S = 1.0

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


class ExitCode(enum.IntEnum):
    """The one exit-code table (README, DESIGN section 7)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    UNREACHABLE = 3
    PRECONDITION = 4
    TRANSITION_FAILED = 5
    TIMEOUT = 6


class EepError(Exception):
    """An error with a documented exit code; its message is one line for stderr."""

    exit_code: ExitCode = ExitCode.ERROR

    def __init__(self, message: str, *, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail or {}


class UsageError(EepError):
    exit_code = ExitCode.USAGE


class UnreachableError(EepError):
    exit_code = ExitCode.UNREACHABLE


class PreconditionError(EepError):
    exit_code = ExitCode.PRECONDITION


class TransitionFailed(EepError):
    exit_code = ExitCode.TRANSITION_FAILED


class TransitionTimeout(EepError):
    exit_code = ExitCode.TIMEOUT


ERRORS_BY_CODE: dict[int, type[EepError]] = {
    int(cls.exit_code): cls
    for cls in (EepError, UsageError, UnreachableError, PreconditionError, TransitionFailed, TransitionTimeout)
}


def error_from_record(record: dict[str, Any]) -> EepError:
    """Rebuild an error that crossed a process boundary as {"code", "message", "detail"}."""
    cls = ERRORS_BY_CODE.get(int(record.get("code", 1)), EepError)
    return cls(str(record.get("message", "unknown error")), detail=record.get("detail") or {})


def validate_name(value: str, what: str = "deployment name") -> str:
    """Names reach Ray as actor names and namespaces: keep them to DNS-label shape."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise UsageError(
            f"invalid {what} {value!r}: use 1-40 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit"
        )
    return value


class RankState(str, enum.Enum):
    STARTING = "starting"
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


# Phases whose per-operation durations `eepctl events` reports, in protocol order.
REPORTED_PHASES = ("launch", "prepare", "transfer", "drain", "commit", "reshuffle", "warm", "capture")


class OpState(str, enum.Enum):
    PLANNED = "planned"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


class DeploymentKind(str, enum.Enum):
    REFERENCE = "reference"
    VLLM = "vllm"


@dataclass
class RankStatus:
    """One rank as the registry sees it (DESIGN section 6). JSON schema: docs/status-schema.md."""

    deployment: str
    rank: int
    instance_id: str
    engine_id: str
    kind: str = DeploymentKind.REFERENCE.value
    node: str = ""
    node_id: str = ""  # the Ray node id (empty under the process launcher)
    node_ip: str = ""  # the address this rank's store and gloo device use
    pid: int = 0
    device: str = "cpu"
    state: str = RankState.STARTING.value
    state_reason: str = ""
    dp_size: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    slots_used: int = 0
    slots_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    workspace_bytes: int = 0
    workspace_locked: bool = False
    workspace_required_bytes: int = 0
    graphs_captured: int = 0
    capture_sizes: list[int] = field(default_factory=list)
    graph_kind: str = "cpu-static"  # "cuda" where CUDA graphs apply
    graph_replays: int = 0
    last_capture_s: float | None = None
    captures_this_op: int = 0
    current_op: str = ""
    eplb_step: int = 0
    eplb_imbalance: float = 0.0
    physical_experts: int = 0
    logical_experts: int = 0
    steps: int = 0
    last_heartbeat: float = 0.0
    heartbeat_age_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankStatus:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Event:
    """One phase of one operation on one rank (rank -1: the controller)."""

    op_id: str
    rank: int
    phase: str
    start: float
    end: float
    outcome: str = "ok"
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end - self.start)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["duration_s"] = round(self.duration_s, 6)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Event:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Operation:
    """A scale operation as recorded by the registry."""

    op_id: str
    deployment: str
    from_size: int
    to_size: int
    state: str = OpState.RUNNING.value
    phase: str = Phase.PLAN.value
    started: float = field(default_factory=time.time)
    finished: float | None = None
    error: str = ""
    error_code: int = 0
    phase_durations: dict[str, float] = field(default_factory=dict)
    serving_pause_s: float = 0.0
    captures_per_rank: dict[str, int] = field(default_factory=dict)
    workspace_before: dict[str, int] = field(default_factory=dict)
    workspace_after: dict[str, int] = field(default_factory=dict)
    rank_states: dict[str, str] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Operation:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def now() -> float:
    return time.time()
