"""A rank's serving loop: one agreed header per step across the DP group, then a step.

Every step starts with an all-reduce (MAX) of a small header, so all ranks agree on whether
anyone has work, the padded size and whether every rank is ready to commit a transition.
Idle ranks sleep on a store key until someone has work; pure-decode steps replay a capture.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import TYPE_CHECKING, Any

import torch

from engine_ext.elastic.graphs import GraphReleasedError, StaleGraphError
from engine_ext.model.model import Batch
from engine_ext.rank.recovery import is_peer_failure
from engine_ext.rank.scheduler import NULL_BLOCK, ScheduledItem

if TYPE_CHECKING:
    from engine_ext.rank.engine import RankEngine

# Header of the per-step agreement across DP ranks (all-reduced with MAX).
H_WORK, H_TOKENS, H_PREFILL, H_DECODES, H_NOT_READY = range(5)


class StepLoop:
    """The step thread of one rank and the batches it runs."""

    def __init__(self, engine: RankEngine) -> None:
        self.engine = engine
        self.wake_idx = 0
        self.thread: threading.Thread | None = None

    # ---- thread and wake-ups -------------------------------------------------------------------
    def start(self, target: Any = None, name: str = "step-loop") -> None:
        self.thread = threading.Thread(target=target or self.run, name=f"{name}-{self.engine.rank}", daemon=True)
        self.thread.start()

    def reset_wake(self) -> None:
        """A new group starts its idle rounds from 0 on every rank."""
        self.wake_idx = 0

    def poke(self) -> None:
        """Wake every rank of the group if they sleep (the key of the current idle round)."""
        e = self.engine
        with e.lock:
            group, idx = e.group, self.wake_idx
        if group is None:
            return
        with contextlib.suppress(Exception):
            group.wake_store.set(f"wake/{idx}", b"1")

    # ---- the loop -------------------------------------------------------------------------------
    def header(self, items: list[ScheduledItem]) -> torch.Tensor:
        e = self.engine
        h = torch.zeros(5, dtype=torch.int64)
        h[H_WORK] = 1 if e.sched.has_work else 0
        h[H_TOKENS] = sum(len(i.feed) for i in items)
        h[H_PREFILL] = 1 if any(len(i.feed) != 1 for i in items) else 0
        h[H_DECODES] = len(items)
        h[H_NOT_READY] = 0 if e.transition.commit_ready else 1
        return h

    def run(self) -> None:
        e = self.engine
        try:
            while not e.stopping and not e.halting:
                with e.lock:
                    items = e.sched.schedule()
                hdr = e.group.all_reduce_max(self.header(items))  # type: ignore[union-attr]
                if hdr[H_NOT_READY] == 0:
                    if not e.transition.commit():
                        return  # this rank left the deployment
                    continue
                if hdr[H_WORK] == 0:
                    self.idle()
                    continue
                self.step(items, hdr)
        except Exception as ex:
            if e.stopping:
                return
            if e.halting or is_peer_failure(ex):  # a peer died (or recovery aborted the group)
                e.recovery.degrade(ex)
            else:
                e.fail(ex)

    def idle(self) -> None:
        e = self.engine
        with e.lock:
            self.wake_idx += 1
            idx = self.wake_idx
            pending = e.sched.has_work or e.transition.commit_ready or e.stopping or e.halting
        group = e.group
        assert group is not None
        if pending:
            group.wake_store.set(f"wake/{idx}", b"1")
        if group.rank == 0 and idx >= 3:
            with contextlib.suppress(Exception):
                group.wake_store.delete_key(f"wake/{idx - 2}")
        while not e.stopping and not e.halting:
            try:
                group.wait_store.wait([f"wake/{idx}"], datetime.timedelta(seconds=30))
                return
            except Exception as ex:  # a timeout re-arms; a dead store is a real failure
                if "timeout" not in str(ex).lower() and "timed out" not in str(ex).lower():
                    raise

    # ---- one step -------------------------------------------------------------------------------
    def batch(self, items: list[ScheduledItem], n: int) -> Batch:
        """The scheduled tokens padded to ``n`` (padding names the null slot, whose blocks are null).
        A request fed from position 0 was just admitted: its slot's block table row is written now."""
        e = self.engine
        model = e.model
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
        dev = e.device
        return Batch(torch.tensor(tok, device=dev), torch.tensor(pos, device=dev),
                     torch.tensor(req_slots, dtype=torch.int64, device=dev), torch.tensor(valid, device=dev))

    def step(self, items: list[ScheduledItem], hdr: torch.Tensor) -> None:
        e = self.engine
        # The padded size depends only on the agreed header and the config, never on this rank's
        # graphs: ranks whose captures differ still issue collectives of the same shape.
        size = None
        if int(hdr[H_PREFILL]) == 0:
            size = next((c for c in sorted(e.cfg.capture_sizes) if c >= int(hdr[H_DECODES])), None)
        if size is not None:
            logits = self.replay(items, size)
        else:
            n = max(1, int(hdr[H_TOKENS]))
            logits = e.model.forward(self.batch(items, n), e.group, e.workspace)
        e.eplb.record(e.model.take_expert_load())  # what this step's forward pass recorded
        e.steps += 1
        finished = self.apply_logits(items, logits)
        # Stream this step's tokens (fire-and-forget): the router re-submits a request with them
        # if this rank dies, so it continues where it was.
        streamed = {it.request.request_id: [it.request.output[-1], it.request.logits[-1]]
                    for it in items if not it.request.done}
        if streamed:
            e.telemetry.send("tokens", {"tokens": streamed})
        if finished:
            e.telemetry.sink("results", {"results": finished})

    def apply_logits(self, items: list[ScheduledItem], logits: torch.Tensor) -> list[dict[str, Any]]:
        """Greedy sampling at each request's last fed token; returns the finished requests."""
        e = self.engine
        finished: list[dict[str, Any]] = []
        row = 0
        with e.lock:
            for it in items:
                row += len(it.feed)
                req = it.request
                req.num_computed = it.start + len(it.feed)
                last = logits[row - 1]
                tok = int(torch.argmax(last))
                req.output.append(tok)
                req.logits.append(float(last[tok]))
                if req.done:
                    e.sched.finish(req)
                    res = req.to_wire()
                    res["rank"] = e.rank
                    finished.append(res)
        return finished

    def replay(self, items: list[ScheduledItem], size: int) -> torch.Tensor:
        e = self.engine
        batch = self.batch(items, size)
        try:
            step = e.graphs.check(size)
        except (KeyError, GraphReleasedError):  # nothing captured for this size: eager, same shape
            return e.model.forward(batch, e.group, e.workspace)
        except StaleGraphError as ex:
            # The check refuses the replay; serve this step eagerly at the same padded size so
            # the DP collectives still match, and make the violation visible.
            e.stale_replays_refused += 1
            e.state_reason = f"stale graph refused: {ex}"
            with e.telemetry.phase(e.current_op or "serving", "stale_graph_refused", batch_size=size):
                pass
            return e.model.forward(batch, e.group, e.workspace)
        for name in ("token_ids", "positions", "req_slots", "valid"):
            step.inputs[name].copy_(getattr(batch, name))
        return e.graphs.replay(size)  # the captured step recorded its load into the captured expert_load
