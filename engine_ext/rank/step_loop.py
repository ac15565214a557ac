"""A rank's serving loop: one agreed header per step across the DP group, then a step.

Every step starts with an all-reduce (MAX) of a small header, so all ranks agree on whether
anyone has work, the padded size and whether every rank is ready to commit a transition.
Idle ranks sleep on a store key until someone has work; pure-decode steps replay a capture.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from engine_ext.elastic.graphs import GraphReleasedError, StaleGraphError
from engine_ext.model.model import Batch
from engine_ext.rank.latency import request_latency
from engine_ext.rank.scheduler import ScheduledItem
from engine_ext.rank.shared import RankResources, RankShared
from engine_ext.rank.telemetry import RankTelemetry

# Header of the per-step agreement across DP ranks (all-reduced with MAX).
H_WORK, H_TOKENS, H_PREFILL, H_DECODES, H_NOT_READY = range(5)


class StepLoop:
    """The step thread of one rank and the batches it runs.

    ``commit`` runs the agreed commit of a transition (False: this rank left); ``on_error``
    decides what a failed step means (a peer died, or this rank is broken). The engine wires
    both to RankTransition and RankRecovery."""

    def __init__(self, res: RankResources, shared: RankShared, telemetry: RankTelemetry) -> None:
        self.res = res
        self.shared = shared
        self.telemetry = telemetry
        self.thread: threading.Thread | None = None
        self.asleep: threading.Thread | None = None  # the step thread while it sleeps on the store
        self.abandoned = 0  # step threads left asleep on a store that did not answer
        self.commit: Callable[[], bool] = lambda: False
        self.on_error: Callable[[BaseException], None] = lambda ex: None

    def wire(self, commit: Callable[[], bool], on_error: Callable[[BaseException], None]) -> None:
        self.commit, self.on_error = commit, on_error

    # ---- thread and wake-ups -------------------------------------------------------------------
    def start(self, target: Any = None, name: str = "step-loop") -> None:
        self.thread = threading.Thread(target=target or self.run, name=f"{name}-{self.shared.rank}", daemon=True)
        self.thread.start()

    def poke(self) -> None:
        """Wake every rank of the group if they sleep."""
        self.shared.wake()

    def join(self, timeout_s: float, idle_grace_s: float = 1.0) -> bool:
        """Wait for the step thread to end; whether it did. A thread still asleep on the store
        after ``idle_grace_s`` is abandoned instead: a store behind a partition answers nobody
        (no reset, and its wait outlived its timeout), so a recovery would wait for it in vain.
        Asleep, it holds no lock and no step; when its wait returns it sees it is not the loop's
        thread any more and ends, touching nothing."""
        thread = self.thread
        if thread is None or not thread.is_alive():
            return True
        deadline = time.monotonic() + timeout_s
        grace = time.monotonic() + idle_grace_s
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.1)
            if thread.is_alive() and self.asleep is thread and time.monotonic() >= grace:
                self.thread = None
                self.abandoned += 1
                return True
        return not thread.is_alive()

    # ---- the loop -------------------------------------------------------------------------------
    def header(self, items: list[ScheduledItem]) -> torch.Tensor:
        h = torch.zeros(5, dtype=torch.int64)
        h[H_WORK] = 1 if self.res.sched.has_work else 0
        h[H_TOKENS] = sum(len(i.feed) for i in items)
        h[H_PREFILL] = 1 if any(len(i.feed) != 1 for i in items) else 0
        h[H_DECODES] = len(items)
        h[H_NOT_READY] = 0 if self.shared.commit_ready and not self._commit_held_back() else 1
        return h

    def _commit_held_back(self) -> bool:
        """A test's hold in a paused phase (faults.PAUSED_PHASES) keeps this rank from agreeing to
        commit until it holds a request with output tokens, for at most the group's timeout."""
        op = self.shared.op
        if op is None or not self.res.faults.commit_waits_for_requests(op.role):
            return False
        with self.shared.lock:
            holds = any(r.output for r in self.res.sched.running)
        op.commit_held_since = op.commit_held_since or time.monotonic()
        return not holds and time.monotonic() - op.commit_held_since < self.res.cfg.group_timeout_s

    def _running(self) -> bool:
        return (
            not self.shared.stopping and not self.shared.halting.is_set() and threading.current_thread() is self.thread
        )

    def run(self) -> None:
        shared = self.shared
        limited = None  # the group whose waits are limited to the step timeout
        try:
            while self._running():
                if shared.group is not limited:  # a new group (start, commit, recovery) serves now
                    limited = shared.group
                    limited.limit_waits(self.res.cfg.step_timeout_s)  # type: ignore[union-attr]
                began = time.monotonic()
                with shared.lock:
                    items = self.res.sched.schedule()
                hdr = shared.group.all_reduce_max(self.header(items))  # type: ignore[union-attr]
                if hdr[H_NOT_READY] == 0:
                    # A commit's collectives wait as long as the operation allows, not a step's.
                    limited.restore_waits()  # type: ignore[union-attr]
                    limited = None
                    if not self.commit():
                        return  # this rank left the deployment
                    continue
                if hdr[H_WORK] == 0:
                    self.idle()
                    continue
                self.step(items, hdr, began)
        except Exception as ex:  # noqa: BLE001 - whatever failed, on_error decides what it means
            if not shared.stopping and threading.current_thread() is self.thread:
                self.on_error(ex)  # (an abandoned thread's world is gone: nothing to decide)

    def idle(self) -> None:
        if not self._running():
            return
        me = threading.current_thread()
        self.asleep = me
        try:
            self._sleep()
        finally:
            if self.asleep is me:  # an abandoned thread must not clear what its successor set
                self.asleep = None

    def _sleep(self) -> None:
        """Sleep on the group's store until a rank has work (or the wait times out: re-armed)."""
        shared = self.shared
        with shared.lock:
            shared.wake_round += 1
            idx = shared.wake_round
            pending = self.res.sched.has_work or shared.commit_ready or shared.stopping or shared.halting.is_set()
        group = shared.group
        assert group is not None
        if pending:
            group.wake_store.set(f"wake/{idx}", b"1")
        if group.rank == 0 and idx >= 3:
            with contextlib.suppress(Exception):
                group.wake_store.delete_key(f"wake/{idx - 2}")
        while self._running():
            if group.wait_wake(f"wake/{idx}", datetime.timedelta(seconds=30)):  # False: timed out, re-arm
                return

    # ---- one step -------------------------------------------------------------------------------
    def batch(self, items: list[ScheduledItem], n: int) -> Batch:
        """The scheduled tokens padded to ``n`` (padding names the null slot, whose blocks are null).
        A request fed from position 0 was just admitted: its slot's block table row is written now."""
        model = self.res.model
        tok, pos, req_slots, valid = [], [], [], []
        for it in items:
            if it.start == 0:
                model.set_slot_blocks(it.request.slot, it.request.blocks)
            for j, t in enumerate(it.feed):
                tok.append(t)
                pos.append(it.start + j)
                req_slots.append(it.request.slot)
                valid.append(True)
        pad = n - len(tok)
        tok += [0] * pad
        pos += [0] * pad
        req_slots += [model.null_slot] * pad
        valid += [False] * pad
        dev = self.res.device
        return Batch(
            torch.tensor(tok, device=dev),
            torch.tensor(pos, device=dev),
            torch.tensor(req_slots, dtype=torch.int64, device=dev),
            torch.tensor(valid, device=dev),
        )

    def step(self, items: list[ScheduledItem], hdr: torch.Tensor, began: float | None = None) -> None:
        """One step of ``items``; ``began``: when its scheduling started (monotonic), so the
        served-tokens counters time the whole step, its header's all-reduce included."""
        res, shared = self.res, self.shared
        began = time.monotonic() if began is None else began
        saturated = res.sched.saturated  # its schedule left requests waiting: the batch is as full as it can be
        if res.faults.fail_now("step"):
            raise RuntimeError("injected by a test fault: out of memory in this rank's step")
        if res.faults.holds("step") and any(it.request.output for it in items):
            res.faults.hold("step")  # a test's window to kill this rank with requests mid-decode
        # The padded size depends only on the agreed header and the config, never on this rank's
        # graphs: ranks whose captures differ still issue collectives of the same shape.
        size = None
        if int(hdr[H_PREFILL]) == 0:
            size = next((c for c in sorted(res.cfg.capture_sizes) if c >= int(hdr[H_DECODES])), None)
        if size is not None:
            logits = self.replay(items, size)
        else:
            n = max(1, int(hdr[H_TOKENS]))
            logits = res.model.forward(self.batch(items, n), shared.group, res.workspace)
        res.eplb.record(res.model.take_expert_load())  # what this step's forward pass recorded
        shared.steps += 1
        finished = self.apply_logits(items, logits)
        # tokens served: a prefill's positions and the token it produced, a decode's one token
        res.sched.served.add(sum(len(it.feed) + (it.start == 0) for it in items), time.monotonic() - began, saturated)
        # Stream this step's tokens (fire-and-forget): the router re-submits a request with them
        # if this rank dies, so it continues where it was (the fault no_token_stream switches it off).
        streamed = {
            it.request.request_id: [it.request.output[-1], it.request.logits[-1], len(it.request.output) - 1]
            for it in items
            if not it.request.done
        }
        if streamed and not res.faults.active("no_token_stream"):
            self.telemetry.send("tokens", {"tokens": streamed})
        if finished:
            self.telemetry.sink("results", {"results": finished})

    def apply_logits(self, items: list[ScheduledItem], logits: torch.Tensor) -> list[dict[str, Any]]:
        """Greedy sampling at each request's last fed token; returns the finished requests."""
        finished: list[dict[str, Any]] = []
        row = 0
        with self.shared.lock:
            for it in items:
                row += len(it.feed)
                req = it.request
                req.num_computed = it.start + len(it.feed)
                last = logits[row - 1]
                tok = int(torch.argmax(last))
                req.output.append(tok)
                req.logits.append(float(last[tok]))
                now = time.time()
                if len(req.output) == 1:  # its first token (a request moved here with tokens has none)
                    req.first_token_at = now
                if req.done:
                    self.res.sched.finish(req)
                    out = req.to_wire()
                    out["rank"] = self.shared.rank
                    out["ttft_ms"], out["tpot_ms"] = request_latency(
                        req.arrival, req.first_token_at, now, len(req.output)
                    )
                    self.res.sched.latency.add(out["ttft_ms"], out["tpot_ms"], now)
                    finished.append(out)
        return finished

    def replay(self, items: list[ScheduledItem], size: int) -> torch.Tensor:
        res, shared = self.res, self.shared
        batch = self.batch(items, size)
        try:
            step = res.graphs.check(size)
        except (KeyError, GraphReleasedError):  # nothing captured for this size: eager, same shape,
            res.graphs.count_eager(size)  # counted: the config captures this size (the registry flags it)
            return res.model.forward(batch, shared.group, res.workspace)
        except StaleGraphError as ex:
            # The check refuses the replay; serve this step eagerly at the same padded size so
            # the DP collectives still match, and make the violation visible.
            shared.stale_replays_refused += 1
            shared.state_reason = f"stale graph refused: {ex}"
            with self.telemetry.phase(shared.current_op or "serving", "stale_graph_refused", batch_size=size):
                pass
            return res.model.forward(batch, shared.group, res.workspace)
        for name in ("token_ids", "positions", "req_slots", "valid"):
            step.inputs[name].copy_(getattr(batch, name))
        return res.graphs.replay(size)  # the captured step recorded its load into the captured expert_load
