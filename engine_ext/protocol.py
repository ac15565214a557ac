"""What the engines, the in-cluster actors and eepctl agree on: names, defaults and timings.

The records (engine_ext.records) and the errors with their exit codes (engine_ext.errors) are
re-exported here, so ``from engine_ext.protocol import ...`` keeps working. Nothing here may
pull in torch or ray: eepctl imports this module on every command.
"""

from __future__ import annotations

import re

from engine_ext.errors import (
    EepError,
    ExitCode,
    PreconditionError,
    TransitionFailed,
    TransitionTimeout,
    UnreachableError,
    UsageError,
    error_from_record,
    error_record,
)
from engine_ext.records import (
    REPORTED_PHASES,
    DeploymentKind,
    Event,
    Operation,
    OpState,
    Phase,
    RankState,
    RankStatus,
    VllmRankStatus,
    from_builtins,
    to_builtins,
)

__all__ = [
    "DEFAULT_DEPLOYMENT",
    "DEFAULT_NAMESPACE",
    "REPORTED_PHASES",
    "SCHEMA_VERSION",
    "STALE_AFTER_S",
    "DeploymentKind",
    "EepError",
    "Event",
    "ExitCode",
    "OpState",
    "Operation",
    "Phase",
    "PreconditionError",
    "RankState",
    "RankStatus",
    "TransitionFailed",
    "TransitionTimeout",
    "UnreachableError",
    "UsageError",
    "VllmRankStatus",
    "error_from_record",
    "error_record",
    "from_builtins",
    "to_builtins",
    "validate_name",
]

SCHEMA_VERSION = 1  # of every JSON object eepctl prints (docs/status-schema.md)
DEFAULT_NAMESPACE = "eepctl"
DEFAULT_DEPLOYMENT = "moe"

# A rank is "stale" when its newest heartbeat is older than this.
STALE_AFTER_S = 4.0

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


def validate_name(value: str, what: str = "deployment name") -> str:
    """Names reach Ray as actor names and namespaces: keep them to DNS-label shape."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise UsageError(
            f"invalid {what} {value!r}: use 1-40 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit"
        )
    return value
