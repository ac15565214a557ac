"""Request slots, the paged KV block pool and continuous batching with greedy decoding."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine_ext.config import EngineConfig
from engine_ext.rank.latency import LatencyWindow, RequestSeconds, ServedTokens

NULL_BLOCK = 0


class NoFreeSlotError(RuntimeError):
    pass


class NoFreeBlocksError(RuntimeError):
    pass


class RequestRejected(ValueError):
    """A request that can never be served by this configuration."""


class SlotPool:
    def __init__(self, n: int) -> None:
        self.total = n
        self._free: list[int] = list(range(n - 1, -1, -1))  # pop() hands out slot 0 first

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlotError(f"no free request slot: all {self.total} slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.total:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self._free)


class BlockPool:
    """KV blocks 1..total; block 0 is the null block, never handed to a request.

    ``resize`` follows the rank's memory budget: bytes the MoE workspace gives back on a
    scale-down become blocks; on a scale-up free blocks above the new total leave the pool at
    once and live ones when their request finishes (the KV tensor keeps its ceiling)."""

    def __init__(self, n: int) -> None:
        self.ceiling = n - 1
        self.total = n - 1
        self._free: deque[int] = deque(range(1, n))
        self._allocated: set[int] = set()

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} KV blocks, {len(self._free)} free of {self.total}")
        got = [self._free.popleft() for _ in range(n)]
        self._allocated.update(got)
        return got

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._allocated.discard(b)
            if b <= self.total:
                self._free.append(b)

    def resize(self, total: int) -> None:
        """Make blocks 1..``total`` the pool (capped at the KV tensor's ceiling)."""
        total = max(1, min(total, self.ceiling))
        if total < self.total:
            self._free = deque(b for b in self._free if b <= total)
        else:
            self._free.extend(b for b in range(self.total + 1, total + 1) if b not in self._allocated)
        self.total = total

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._allocated)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    logits: list[float] = field(default_factory=list)
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    arrival: float = field(default_factory=time.time)
    moved_from: list[int] = field(default_factory=list)
    first_token_at: float | None = None  # on this rank (engine_ext/rank/latency.py)
    # Output tokens the request already had when this rank took it: a request re-routed off a
    # dead rank carries the tokens that rank streamed, so this is > 0 exactly when it continued.
    resumed_with: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens

    def to_wire(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "output": list(self.output),
            "logits": list(self.logits),
            "moved_from": list(self.moved_from),
            "resumed_with": self.resumed_with,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Request:
        """The request as this rank takes it: ``resumed_with`` counts the tokens it arrives with."""
        output = list(d.get("output", []))
        return cls(
            d["request_id"],
            list(d["prompt"]),
            int(d["max_tokens"]),
            output,
            list(d.get("logits", [])),
            moved_from=list(d.get("moved_from", [])),
            resumed_with=len(output),
        )


@dataclass
class ScheduledItem:
    request: Request
    feed: list[int]  # tokens whose KV this step computes
    start: int  # position of feed[0]


class Scheduler:
    """Continuous batching over the slot and block pools. Not thread-safe: callers hold the
    rank's ``RankShared.lock`` (control calls add, the step thread schedules and finishes)."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.slots = SlotPool(cfg.max_num_seqs)
        self.blocks = BlockPool(cfg.num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.latency = LatencyWindow()  # TTFT/TPOT of the requests finished here
        self.held = RequestSeconds()  # the autoscaler's queue signal, time-weighted
        self.served = ServedTokens()  # the autoscaler's capacity signal: tokens served, saturated steps
        self.saturated = False  # the last schedule left requests waiting

    def validate(self, req: Request) -> None:
        cfg = self.cfg
        if not req.prompt:
            raise RequestRejected("prompt is empty")
        if any(not 0 <= t < cfg.vocab_size for t in req.prompt):
            raise RequestRejected(f"prompt token ids must be in [0, {cfg.vocab_size})")
        if req.max_tokens < 1:
            raise RequestRejected("max_tokens must be >= 1")
        if len(req.prompt) + req.max_tokens > cfg.max_model_len:
            raise RequestRejected(f"prompt + max_tokens exceeds max_model_len {cfg.max_model_len}")
        if len(req.tokens) > cfg.max_num_tokens:
            raise RequestRejected(f"prompt longer than max_num_tokens {cfg.max_num_tokens}")

    def add(self, req: Request) -> None:
        self.validate(req)
        self.waiting.append(req)
        self.held.change(+1)

    def tokens_queued(self) -> int:
        """The work this rank holds, in tokens as ``ServedTokens`` counts them (a request's prompt
        and its output: ``len(prompt) + max_tokens``): a waiting request's whole, a running one's
        output still to come (whole until its prefill ran). Read from copies of the queues (taken
        whole under the GIL), so the status thread needs no lock the step thread holds."""
        waiting, running = list(self.waiting), list(self.running)
        return sum(len(r.prompt) + r.max_tokens for r in waiting) + sum(
            r.max_tokens - len(r.output) if r.num_computed else len(r.prompt) + r.max_tokens for r in running
        )

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> list[ScheduledItem]:
        """Decodes first, then admit waiting requests while slots, blocks and tokens allow."""
        budget = self.cfg.max_num_tokens
        items: list[ScheduledItem] = []
        for req in self.running:
            feed = req.tokens[req.num_computed :]
            if len(feed) > budget:
                continue
            items.append(ScheduledItem(req, feed, req.num_computed))
            budget -= len(feed)
        while self.waiting and self.slots.free and budget > 0:
            req = self.waiting[0]
            need_tokens = len(req.tokens)
            need_blocks = -(-(len(req.prompt) + req.max_tokens) // self.cfg.block_size)
            if need_tokens > budget or need_blocks > self.blocks.free:
                break
            self.waiting.popleft()
            req.slot = self.slots.allocate()
            req.blocks = self.blocks.allocate(need_blocks)
            req.num_computed = 0
            self.running.append(req)
            items.append(ScheduledItem(req, req.tokens, 0))
            budget -= need_tokens
        self.saturated = bool(self.waiting)  # requests left waiting: this batch is as full as it can be
        return items

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.held.change(-1)
        self.slots.release(req.slot)
        self.blocks.release(req.blocks)
        req.slot, req.blocks = -1, []

    def export_all(self) -> list[Request]:
        """Take every unfinished request out (scale-down moves them to a remaining rank)."""
        out = list(self.running) + list(self.waiting)
        for req in list(self.running):
            self.finish(req)
        self.held.change(-len(self.waiting))
        self.waiting.clear()
        for req in out:
            req.num_computed = 0
        return out

    def give_back(self, keep: int) -> list[Request]:
        """Take out the waiting requests beyond the first ``keep`` (the newest: the oldest keep
        their turn here), in arrival order. None of them was prefilled: they hold no slot or block."""
        n = max(0, len(self.waiting) - max(0, keep))
        out = [self.waiting.pop() for _ in range(n)][::-1]
        self.held.change(-n)
        return out

    def live_blocks(self) -> list[int]:
        return sorted(b for r in self.running for b in r.blocks)
