"""Configuration of the reference engine. Plain dataclasses: the controller reads them without torch."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class Policy(enum.StrEnum):
    """A policy chosen by name. A StrEnum: it equals, prints and serialises (JSON, Ray
    arguments, records) as its plain value."""

    @classmethod
    def parse(cls, value: Any, option: str) -> Any:
        """The member named ``value``, or ValueError saying what ``option`` accepts."""
        try:
            return cls(value)
        except ValueError:
            names = " or ".join(m.value for m in cls)
            raise ValueError(f"{option} must be {names}, not {value!r}") from None


class CapturePolicy(Policy):
    """How ranks capture across transitions (engine_ext/rank/capture_reuse.py)."""

    RECAPTURE = "recapture"  # re-size the workspace and capture once per transition
    REUSE = "reuse"  # size workspace and captures for capture_world at start and keep them
    # reuse where the rank's KV budget holds reuse's workspace and still every request slot at
    # max_model_len, else recapture; a deployment resolves it before any rank starts
    # (engine_ext/capture_memory.py ``size_captures``)
    AUTO = "auto"


class RankFailurePolicy(Policy):
    """What a deployment does when a rank dies (engine_ext/control/recovery.py)."""

    SHRINK = "shrink"  # serve at the healthy size
    REPLACE = "replace"  # shrink, then grow back to the desired size


class AutoscaleMode(Policy):
    """What the autoscaler does with its recommendations (engine_ext/control/autoscaler.py)."""

    ADVISORY = "advisory"  # compute and record them, act on none (the default when first enabled)
    ON = "on"  # act: move the desired size
    OFF = "off"  # record signals only; recommend nothing for action


TRANSPORTS = ("gloo", "auto")  # EngineConfig.transport


@dataclass
class KVTransferConfig:
    engine_id: str = ""


@dataclass
class EngineConfig:
    # model
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128
    slots_per_rank: int = 8  # physical expert slots per rank; redundant = slots*DP - experts
    dtype: str = "float32"
    seed: int = 0
    # serving
    block_size: int = 8
    num_blocks: int = 128
    max_num_seqs: int = 8
    max_num_tokens: int = 64
    max_model_len: int = 128
    capture_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    # CapturePolicy: "recapture", "reuse" (then captures are sized for capture_world, the
    # deployment's max DP by default) or "auto" (one of them, chosen by the deployment:
    # capture_memory.size_captures; a rank started without a deployment, which knows no max DP,
    # recaptures).
    capture_policy: CapturePolicy | str = CapturePolicy.AUTO
    capture_world: int = 0
    # identity (suffixed with _dp<rank> per rank)
    instance_id: str = "moe"
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    # collectives
    backend: str = "gloo"
    # The per-step collectives' transport: "auto" uses shared memory when every rank of a world
    # shares one host (CPU tensors, x86-64), gloo otherwise; "gloo" always uses gloo. Chosen again
    # for every world (engine_ext/transport/shm.py), so a mixed world (a joiner on another node)
    # goes back to gloo at that transition (docs/benchmarks.md "Capacity against width").
    transport: str = "auto"
    # The most expert bytes one exchange of a scale's pre-copy carries: consecutive moves go
    # together up to it (one handshake for many moves; the staging of a move through host or
    # shared memory holds at most this much). CUDA IPC stages nothing: its pre-copy is one
    # exchange. 0: one move per exchange (every transport).
    move_batch_bytes: int = 1 << 30
    # Threads a CPU rank copies its landed experts into their slots with, in the commit (the part
    # of a move that cannot happen before the switch): 0 sizes it to the host, its usable cores
    # divided by the ranks of a one-host world (1 where the world spans hosts: their count is
    # unknown), no more than ``OMP_NUM_THREADS`` where set (Ray sets it to a rank's CPU grant), at
    # most 8 and one per 8 MiB loaded. The copy is memory-bound: one thread moved 4.4-6 GB/s.
    commit_load_threads: int = 0
    group_timeout_s: float = 120.0
    # A serving step's collectives wait this long for a peer (gloo's per-operation timeout on the
    # live group while it serves): a peer that hangs or is cut off fails the step in seconds, the
    # survivors degrade and the controller fences it, instead of every rank waiting
    # ``group_timeout_s``. Operations (warm-up, reshuffle) keep ``group_timeout_s``.
    step_timeout_s: float = 5.0
    # Deliberately broken variants and phase holds (engine_ext.faults.VARIANTS says what
    # each breaks), used by tests to show each mechanism matters and each check fires.
    faults: list[str] = field(default_factory=list)
    fault_delay_s: float = 5.0

    def __post_init__(self) -> None:
        if self.capture_policy in CapturePolicy.__members__.values():
            self.capture_policy = CapturePolicy(self.capture_policy)  # typed; ``validate`` refuses the rest

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["capture_policy"] = str(self.capture_policy)
        return d

    def size_captures_for(self, max_dp: int) -> None:
        """Under ``reuse``, captures are sized for the largest world a scale may reach: max DP
        unless ``capture_world`` was given. A deployment calls it through
        ``capture_memory.size_captures``, which resolves ``auto`` first."""
        if self.capture_policy == CapturePolicy.REUSE and not self.capture_world:
            self.capture_world = max_dp

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in d.items() if k in known}
        if isinstance(data.get("kv_transfer"), dict):
            data["kv_transfer"] = KVTransferConfig(**data["kv_transfer"])
        return cls(**data)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def validate(self) -> None:
        self.capture_policy = CapturePolicy.parse(self.capture_policy, "capture_policy")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be {' or '.join(TRANSPORTS)}, not {self.transport!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError("top_k must be between 1 and num_experts")
        if not self.step_timeout_s > 0:
            raise ValueError("step_timeout_s must be > 0")
        if self.move_batch_bytes < 0:
            raise ValueError("move_batch_bytes must be >= 0")
        if self.commit_load_threads < 0:
            raise ValueError("commit_load_threads must be >= 0 (0: sized to the host)")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        if max(self.capture_sizes, default=0) > self.max_num_seqs:
            raise ValueError("capture sizes cannot exceed max_num_seqs")
