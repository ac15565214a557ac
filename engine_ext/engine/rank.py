"""One DP rank of the reference engine: serving loop, warm-up/capture and its side of a transition.

Ray-free: the Ray actor (engine_ext.ray.rank_actor) and the process launcher
(engine_ext.engine.launcher) both drive this class, so GPU hosts without Ray run the same
transition code.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import os
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_ext.elastic.comm import StatelessGroup, configure_node, host_store, local_ip
from engine_ext.elastic.rendezvous import Rendezvous
from engine_ext.elastic.eplb import EplbState, ExpertLayout, ExpertMove, plan_moves, transfer_pairs
from engine_ext.elastic.graphs import GraphManager, GraphReleasedError, StaleGraphError
from engine_ext.elastic.identity import apply_dp_identity_suffix
from engine_ext.elastic.workspace import WorkspaceManager
from engine_ext.engine.config import EngineConfig
from engine_ext.engine.model import PLACEHOLDER_SEED_OFFSET, Batch, MoEModel
from engine_ext.engine.scheduler import NULL_BLOCK, Request, Scheduler, ScheduledItem
from engine_ext.protocol import Event, RankState, RankStatus

# What a controller (Ray actor or launcher) may call on a rank.
RANK_METHODS = frozenset({
    "host_store", "join", "warm_and_capture", "serve", "add_request", "status", "prepare",
    "request_commit", "wait_op", "abort", "stop", "recent_events",
})

# Header of the per-step agreement across DP ranks (all-reduced with MAX).
H_WORK, H_TOKENS, H_PREFILL, H_DECODES, H_NOT_READY = range(5)


@dataclass
class TransitionPlan:
    """Everything a rank needs for its side of one operation; built by the controller."""

    op_id: str
    kind: str  # "scale_up" | "scale_down"
    old_size: int
    new_size: int
    rdzv: Rendezvous
    old_layout: ExpertLayout
    new_layout: ExpertLayout
    timeout_s: float = 120.0

    def to_dict(self) -> dict[str, Any]:
        return {"op_id": self.op_id, "kind": self.kind, "old_size": self.old_size, "new_size": self.new_size,
                "rdzv": [self.rdzv.host, self.rdzv.port, self.rdzv.prefix],
                "old_layout": self.old_layout.to_dict(), "new_layout": self.new_layout.to_dict(),
                "timeout_s": self.timeout_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransitionPlan:
        return cls(d["op_id"], d["kind"], d["old_size"], d["new_size"], Rendezvous(*d["rdzv"]),
                   ExpertLayout.from_dict(d["old_layout"]), ExpertLayout.from_dict(d["new_layout"]),
                   d.get("timeout_s", 120.0))

    def role(self, rank: int) -> str:
        if self.kind == "scale_up":
            return "existing" if rank < self.old_size else "joining"
        return "remaining" if rank < self.new_size else "removing"


@dataclass
class _OpState:
    plan: TransitionPlan
    role: str
    standby: StatelessGroup | None = None
    eplb_comm: StatelessGroup | None = None
    prepared: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)


Sink = Callable[[str, dict[str, Any]], None]  # (kind, payload): "status" | "event" | "results"


class RankEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        deployment: str,
        rank: int,
        layout: ExpertLayout,
        *,
        joining: bool = False,
        device: str = "cpu",
        sink: Sink | None = None,
        kind: str = "reference",
        node_id: str = "",
        node_ip: str = "",
        ifname: str = "",
    ) -> None:
        cfg = copy.deepcopy(cfg)
        cfg.validate()
        if not cfg.instance_id:
            cfg.instance_id = deployment
        if not cfg.kv_transfer.engine_id:
            cfg.kv_transfer.engine_id = f"{deployment}-kv"
        if "double_suffix" in cfg.faults:  # broken variant: stacks suffixes (the upstream bug)
            cfg.instance_id = f"{cfg.instance_id}_dp{rank}_dp{rank}"
            cfg.kv_transfer.engine_id = f"{cfg.kv_transfer.engine_id}_dp{rank}_dp{rank}"
        else:
            cfg = apply_dp_identity_suffix(cfg, rank)
        self.cfg = cfg
        self.deployment = deployment
        self.kind = kind
        self.rank = rank
        self.device = torch.device(device)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, int(os.environ.get("EEP_TORCH_THREADS", "1"))))
        seed = cfg.seed + PLACEHOLDER_SEED_OFFSET + rank if joining else cfg.seed
        self.model = MoEModel(cfg, layout, rank, self.device, seed)
        self.workspace = WorkspaceManager(self.device)
        self.graphs = GraphManager(self.device, self.workspace, self.model.buffers)
        self.sched = Scheduler(cfg)
        self.eplb = EplbState(layout, async_started=not joining)
        self.required_workspace = 0
        self.group: StatelessGroup | None = None
        self.state = RankState.STARTING
        self.state_reason = ""
        self.sink = sink or (lambda kind, payload: None)
        self.events: deque[dict[str, Any]] = deque(maxlen=512)
        self.steps = 0
        self.stale_replays_refused = 0
        self.capture_passes = 0  # capture passes in the current operation (I4: exactly one)
        self._lock = threading.RLock()
        self._wake_idx = 0
        self._stop = False
        self._loop_thread: threading.Thread | None = None
        self._hb_thread: threading.Thread | None = None
        self._op: _OpState | None = None
        self._commit_ready = False
        self._store_master = None
        self.node = socket.gethostname()
        # Ray ranks bind and advertise the node IP Ray reports (or the operator's interface);
        # the process launcher (one node, no Ray) keeps the default-route guess.
        self.node_id = node_id
        self.ip = configure_node(node_ip, ifname).ip if (node_ip or ifname) else local_ip()
        self.current_op = ""

    # ---- identity and telemetry ---------------------------------------------------------------
    @property
    def instance_id(self) -> str:
        return self.cfg.instance_id

    @property
    def engine_id(self) -> str:
        return self.cfg.kv_transfer.engine_id

    @property
    def world_size(self) -> int:
        """Read live from the current group (I6): never cached from construction."""
        return 1 if self.group is None else self.group.size

    def status(self) -> dict[str, Any]:
        s = self.sched
        g = self.graphs
        st = RankStatus(
            deployment=self.deployment, rank=self.rank, instance_id=self.instance_id, engine_id=self.engine_id,
            kind=self.kind, node=f"{self.node}/{self.ip}", node_id=self.node_id, node_ip=self.ip, pid=os.getpid(), device=str(self.device),
            state=self.state.value, state_reason=self.state_reason, dp_size=self.world_size,
            requests_running=len(s.running), requests_waiting=len(s.waiting),
            slots_used=s.slots.used, slots_total=s.slots.total,
            kv_blocks_used=s.blocks.used, kv_blocks_total=s.blocks.total,
            workspace_bytes=self.workspace.nbytes, workspace_locked=self.workspace.locked,
            workspace_required_bytes=self.required_workspace,
            graphs_captured=len(g.captured_sizes), capture_sizes=g.captured_sizes, graph_kind=g.kind,
            graph_replays=g.stats.replays, last_capture_s=g.stats.last_capture_s,
            captures_this_op=self.capture_passes, current_op=self.current_op,
            eplb_step=self.eplb.step, eplb_imbalance=self.eplb.imbalance(),
            physical_experts=self.eplb.layout.num_physical, logical_experts=self.eplb.layout.num_logical,
            steps=self.steps, last_heartbeat=time.time(),
        )
        d = st.to_dict()
        d["stale_replays_refused"] = self.stale_replays_refused
        d["eplb_logical_load"] = list(self.eplb.logical_load)
        return d

    def _publish(self) -> None:
        try:
            self.sink("status", self.status())
        except Exception:
            pass

    def _set_state(self, state: RankState, reason: str = "") -> None:
        self.state = state
        self.state_reason = reason
        self._publish()

    @contextlib.contextmanager
    def phase(self, op_id: str, phase: str, **detail: Any) -> Iterator[dict[str, Any]]:
        start = time.time()
        outcome = "ok"
        try:
            yield detail
        except BaseException as e:
            outcome = "error"
            detail["error"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            ev = Event(op_id, self.rank, phase, start, time.time(), outcome, detail).to_dict()
            self.events.append(ev)
            try:
                self.sink("event", ev)
            except Exception:
                pass

    def recent_events(self) -> list[dict[str, Any]]:
        return list(self.events)

    def start_heartbeat(self, interval_s: float = 1.0) -> None:
        def beat() -> None:
            while not self._stop and self.state not in (RankState.REMOVED,):
                self._publish()
                time.sleep(interval_s)

        self._hb_thread = threading.Thread(target=beat, name=f"heartbeat-{self.rank}", daemon=True)
        self._hb_thread.start()

    # ---- group membership -----------------------------------------------------------------
    def host_store(self) -> tuple[str, int]:
        """Rank 0 hosts the deployment's TCPStore; every rendezvous is a prefix in it."""
        if self._store_master is None:
            self._store_master = host_store()
        return self.ip, int(self._store_master.port)

    def join(self, rdzv: Rendezvous | list[Any], world_size: int, timeout_s: float = 120.0) -> None:
        if not isinstance(rdzv, Rendezvous):
            rdzv = Rendezvous(*rdzv)
        self.group = StatelessGroup(rdzv.child("dp"), self.rank, world_size, timeout_s=timeout_s,
                                    backend=self.cfg.backend, device=self.device)
        self.eplb.layout = self.model.layout
        self._wake_idx = 0

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, wire: dict[str, Any]) -> None:
        if self.state in (RankState.FAILED, RankState.REMOVED, RankState.REMOVING) or self._stop:
            raise RuntimeError(f"rank {self.rank} is {self.state.value} and takes no requests"
                               + (f": {self.state_reason}" if self.state_reason else ""))
        req = Request.from_wire(wire)
        with self._lock:
            self.sched.add(req)
        self._poke()

    def _poke(self) -> None:
        """Wake every rank of the group if they sleep (the key of the current idle round)."""
        with self._lock:
            group, idx = self.group, self._wake_idx
        if group is None:
            return
        try:
            group.wake_store.set(f"wake/{idx}", b"1")
        except Exception:
            pass

    # ---- serving loop ------------------------------------------------------------------------
    def serve(self) -> None:
        self._set_state(RankState.SERVING)
        self._loop_thread = threading.Thread(target=self._loop, name=f"step-loop-{self.rank}", daemon=True)
        self._loop_thread.start()

    def _header(self, items: list[ScheduledItem]) -> torch.Tensor:
        h = torch.zeros(5, dtype=torch.int64)
        n_tokens = sum(len(i.feed) for i in items)
        h[H_WORK] = 1 if self.sched.has_work else 0
        h[H_TOKENS] = n_tokens
        h[H_PREFILL] = 1 if any(len(i.feed) != 1 for i in items) else 0
        h[H_DECODES] = len(items)
        h[H_NOT_READY] = 0 if self._commit_ready else 1
        return h

    def _loop(self) -> None:
        try:
            while not self._stop:
                with self._lock:
                    items = self.sched.schedule()
                hdr = self.group.all_reduce_max(self._header(items))  # type: ignore[union-attr]
                if hdr[H_NOT_READY] == 0:
                    if not self._commit():
                        return  # this rank left the deployment
                    continue
                if hdr[H_WORK] == 0:
                    self._idle()
                    continue
                self._step(items, hdr)
        except Exception as e:
            if not self._stop:
                self._fail(e)

    def _idle(self) -> None:
        with self._lock:
            self._wake_idx += 1
            idx = self._wake_idx
            pending = self.sched.has_work or self._commit_ready or self._stop
        group = self.group
        assert group is not None
        if pending:
            group.wake_store.set(f"wake/{idx}", b"1")
        if self.rank == 0 and idx >= 3:
            with contextlib.suppress(Exception):
                group.wake_store.delete_key(f"wake/{idx - 2}")
        while not self._stop:
            try:
                group.wait_store.wait([f"wake/{idx}"], datetime.timedelta(seconds=30))
                return
            except Exception as e:  # a timeout re-arms; a dead store is a real failure
                if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                    raise

    def _batch(self, items: list[ScheduledItem], n: int) -> Batch:
        cfg = self.cfg
        tok, pos, slot, valid = [], [], [], []
        tables: list[list[int]] = []
        maxb = cfg.max_blocks_per_seq
        for it in items:
            blocks = it.request.blocks + [NULL_BLOCK] * (maxb - len(it.request.blocks))
            for j, t in enumerate(it.feed):
                p = it.start + j
                tok.append(t)
                pos.append(p)
                slot.append(blocks[p // cfg.block_size] * cfg.block_size + p % cfg.block_size)
                tables.append(blocks)
                valid.append(True)
        pad = n - len(tok)
        tok += [0] * pad
        pos += [0] * pad
        slot += [0] * pad
        tables += [[NULL_BLOCK] * maxb] * pad
        valid += [False] * pad
        dev = self.device
        return Batch(torch.tensor(tok, device=dev), torch.tensor(pos, device=dev), torch.tensor(slot, device=dev),
                     torch.tensor(tables, dtype=torch.int64, device=dev).reshape(n, maxb),
                     torch.tensor(valid, device=dev))

    def _step(self, items: list[ScheduledItem], hdr: torch.Tensor) -> None:
        counts = torch.zeros(self.cfg.num_experts, dtype=torch.int64, device=self.device)
        # The padded size depends only on the agreed header and the config, never on this rank's
        # graphs: ranks whose captures differ still issue collectives of the same shape.
        size = None
        if int(hdr[H_PREFILL]) == 0:
            size = next((c for c in sorted(self.cfg.capture_sizes) if c >= int(hdr[H_DECODES])), None)
        if size is not None:
            logits = self._replay(items, size, counts)
        else:
            n = max(1, int(hdr[H_TOKENS]))
            logits = self.model.forward(self._batch(items, n), self.group, self.workspace, expert_counts=counts)
        self.eplb.record(counts.tolist())
        self.steps += 1
        finished = self.apply_logits(items, logits)
        if finished:
            self.sink("results", {"results": finished})

    def apply_logits(self, items: list[ScheduledItem], logits: torch.Tensor) -> list[dict[str, Any]]:
        """Greedy sampling at each request's last fed token; returns the finished requests."""
        finished: list[dict[str, Any]] = []
        row = 0
        with self._lock:
            for it in items:
                row += len(it.feed)
                req = it.request
                req.num_computed = it.start + len(it.feed)
                last = logits[row - 1]
                tok = int(torch.argmax(last))
                req.output.append(tok)
                req.logits.append(float(last[tok]))
                if req.done:
                    self.sched.finish(req)
                    res = req.to_wire()
                    res["rank"] = self.rank
                    finished.append(res)
        return finished

    def _replay(self, items: list[ScheduledItem], size: int, counts: torch.Tensor) -> torch.Tensor:
        batch = self._batch(items, size)
        try:
            step = self.graphs.check(size)
        except (KeyError, GraphReleasedError):  # nothing captured for this size: eager, same shape
            return self.model.forward(batch, self.group, self.workspace, expert_counts=counts)
        except StaleGraphError as e:
            # The check refuses the replay; serve this step eagerly at the same padded size so
            # the DP collectives still match, and make the violation visible.
            self.stale_replays_refused += 1
            self.state_reason = f"stale graph refused: {e}"
            with self.phase(self.current_op or "serving", "stale_graph_refused", batch_size=size):
                pass
            return self.model.forward(batch, self.group, self.workspace, expert_counts=counts)
        for name in ("token_ids", "positions", "slot_mapping", "block_tables", "valid"):
            step.inputs[name].copy_(getattr(batch, name))
        out = self.graphs.replay(size)
        counts += step.inputs["expert_counts"]
        return out

    # ---- warm-up and capture ----------------------------------------------------------------
    def live_kv_checksum(self) -> str:
        blocks = self.sched.live_blocks()
        if not blocks:
            return "empty"
        bs = self.cfg.block_size
        idx = torch.tensor([b * bs + j for b in blocks for j in range(bs)], device=self.device)
        data = self.model.kv[:, idx].contiguous().cpu()
        return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]

    def warm_and_capture(self, op_id: str) -> dict[str, Any]:
        """Release graphs -> unlock -> size for the bound -> isolated warm-up -> capture once -> lock.

        Runs in lockstep on every rank of the current group (I4, I5, I7).
        """
        faults = self.cfg.faults
        report: dict[str, Any] = {"workspace_before": self.workspace.nbytes}
        if "skip_release" not in faults:
            report["graphs_released"] = self.graphs.release()
        self._set_state(RankState.WARMING)
        with self.phase(op_id, "warm") as d:
            self.workspace.unlock()
            bound = self.model.moe_workspace_bound(self.world_size)
            self.required_workspace = bound
            d["graphs_live_at_resize"] = len(self.graphs.captured_sizes)  # I3: must be 0
            if "skip_rewarm" not in faults:
                self.workspace.reserve(bound)
            d.update(self._isolated_warmup())
            d["workspace_bytes"] = self.workspace.nbytes
            d["required_bytes"] = bound
            report.update(d)
        # "skip_release" keeps the old captures (none are made where none were released);
        # "double_capture" reproduces upstream before its fix: the re-warm captured a second time.
        if "skip_release" in faults and op_id != "startup":  # every rank alike: captures are collective
            passes = 0
        else:
            passes = 2 if "double_capture" in faults else 1
        for _ in range(passes):
            self._set_state(RankState.CAPTURING)
            with self.phase(op_id, "capture") as d:
                t0 = time.perf_counter()
                for size in self.cfg.capture_sizes:
                    self._capture(size)
                d["sizes"] = list(self.cfg.capture_sizes)
                d["per_size_s"] = {str(k): round(v, 6) for k, v in self.graphs.stats.capture_durations.items()}
                d["total_s"] = time.perf_counter() - t0
                d["graphs_this_op"] = self.graphs.stats.captures_this_op
                d["graph_kind"] = self.graphs.kind
            self.capture_passes += 1
        self.workspace.lock()
        report["workspace_after"] = self.workspace.nbytes
        report["captures_this_op"] = self.capture_passes
        return report

    def _isolated_warmup(self) -> dict[str, Any]:
        """A max_num_tokens batch through the real slot and KV path, touching no serving state (I5)."""
        cfg = self.cfg
        broken = "warmup_not_isolated" in cfg.faults
        slots_before = self.sched.slots.snapshot()
        kv_before = self.live_kv_checksum()
        eplb_before = self.eplb.snapshot()
        # The synthetic batch may use only slots that are free on every rank.
        free = torch.tensor([-self.sched.slots.free], dtype=torch.int64)
        min_free = -int(self.group.all_reduce_max(free)[0]) if self.group else self.sched.slots.free  # type: ignore[union-attr]
        n_req = cfg.max_num_seqs if broken else max(0, min(min_free, cfg.max_num_seqs))
        taken: list[int] = []
        if broken:
            # Takes slots without the cap and frees them out of order (upstream's "No free indices").
            taken = [self.sched.slots.allocate() for _ in range(min(n_req, self.sched.slots.free))]
        else:
            taken = [self.sched.slots.allocate() for _ in range(n_req)]
        n = cfg.max_num_tokens
        live = self.sched.live_blocks()
        if broken and live:  # writes the dummy KV into live blocks
            slot_map = [live[i % len(live)] * cfg.block_size + (i % cfg.block_size) for i in range(n)]
        else:
            slot_map = [NULL_BLOCK * cfg.block_size] * n
        dev = self.device
        maxb = cfg.max_blocks_per_seq
        per = max(1, -(-n // max(1, len(taken))))
        positions = [i % per for i in range(n)]
        g = torch.Generator().manual_seed(1234 + self.rank)
        batch = Batch(torch.randint(0, cfg.vocab_size, (n,), generator=g).to(dev),
                      torch.tensor(positions, device=dev), torch.tensor(slot_map, device=dev),
                      torch.zeros(n, maxb, dtype=torch.int64, device=dev),
                      torch.full((n,), broken, dtype=torch.bool, device=dev))
        counts = torch.zeros(cfg.num_experts, dtype=torch.int64, device=dev)
        if not broken:
            self.eplb.suppressed += 1
        try:
            self.model.forward(batch, self.group, self.workspace, expert_counts=counts)
        finally:
            if not broken:
                self.eplb.suppressed -= 1
        if broken:  # the broken variant lets the dummy batch count as load
            self.eplb.record(counts.tolist())
        for s in (taken if broken else reversed(taken)):
            self.sched.slots.release(s)
        return {
            "warmup_requests": len(taken),
            "warmup_tokens": n,
            "min_free_slots": min_free,
            "slots_restored": self.sched.slots.snapshot() == slots_before,
            "live_kv_unchanged": self.live_kv_checksum() == kv_before,
            "eplb_unchanged": self.eplb.snapshot() == eplb_before,
            "live_kv_checksum": kv_before,
        }

    def _capture(self, size: int) -> None:
        cfg, dev = self.cfg, self.device
        maxb = cfg.max_blocks_per_seq
        inputs = {
            "token_ids": torch.zeros(size, dtype=torch.int64, device=dev),
            "positions": torch.zeros(size, dtype=torch.int64, device=dev),
            "slot_mapping": torch.zeros(size, dtype=torch.int64, device=dev),
            "block_tables": torch.zeros(size, maxb, dtype=torch.int64, device=dev),
            "valid": torch.zeros(size, dtype=torch.bool, device=dev),
            "expert_counts": torch.zeros(cfg.num_experts, dtype=torch.int64, device=dev),
        }
        output = torch.zeros(size, cfg.vocab_size, dtype=self.model.dtype, device=dev)
        batch = Batch(inputs["token_ids"], inputs["positions"], inputs["slot_mapping"],
                      inputs["block_tables"], inputs["valid"])
        steps, ns = self.model.plan(batch, self.group, self.workspace, dense_moe=True,
                                    expert_counts=inputs["expert_counts"])
        steps = [("compute", inputs["expert_counts"].zero_), *steps,
                 ("compute", lambda: output.copy_(ns["logits"]))]
        self.eplb.suppressed += 1
        try:
            self.graphs.capture(size, inputs, output, steps)
        finally:
            self.eplb.suppressed -= 1

    # ---- transition, rank side ---------------------------------------------------------------
    def prepare(self, plan_d: dict[str, Any]) -> dict[str, Any]:
        """Form the standby groups and the EPLB communicator, move non-expert weights (I2).

        Existing ranks run this while their step loop keeps serving on the old group.
        """
        plan = TransitionPlan.from_dict(plan_d)
        role = plan.role(self.rank)
        op = _OpState(plan, role)
        with self._lock:
            self._op = op
            self.current_op = plan.op_id
            self.capture_passes = 0
            self.graphs.begin_operation()
        if role != "joining":
            self._set_state(RankState.PREPARING)
        elif "slow_prepare" in self.cfg.faults:  # test hook: a window to kill a joining rank
            time.sleep(self.cfg.fault_delay_s)
        try:
            with self.phase(plan.op_id, "prepare", role=role) as d:
                t = plan.timeout_s
                if plan.kind == "scale_up":
                    op.standby = StatelessGroup(plan.rdzv.child("dp"), self.rank, plan.new_size, timeout_s=t,
                                                backend=self.cfg.backend, device=self.device)
                    op.eplb_comm = StatelessGroup(plan.rdzv.child("eplb"), self.rank, plan.new_size, timeout_s=t,
                                                  device=self.device)
                else:
                    if role == "remaining":
                        op.standby = StatelessGroup(plan.rdzv.child("dp"), self.rank, plan.new_size, timeout_s=t,
                                                    backend=self.cfg.backend, device=self.device)
                    op.eplb_comm = StatelessGroup(plan.rdzv.child("eplb"), self.rank, plan.old_size, timeout_s=t,
                                                  device=self.device)
                d["eplb_comm_ready_at"] = time.time()
                self.eplb.registered = True
            if plan.kind == "scale_up":
                with self.phase(plan.op_id, "transfer") as d:
                    d.update(self._transfer_dense(op))
            with self.phase(plan.op_id, "prepare_warm_groups"):
                if op.standby is not None:
                    op.standby.barrier()
                op.eplb_comm.barrier()
        except Exception as e:
            op.error = f"{type(e).__name__}: {e}"
            self._drop_op_groups(op)
            if role != "joining":
                self._set_state(RankState.SERVING, f"prepare of {plan.op_id} failed")
            raise
        op.prepared.set()
        if role == "joining":
            self._loop_thread = threading.Thread(target=self._join_commit_then_serve, name=f"joiner-{self.rank}",
                                                 daemon=True)
            self._loop_thread.start()
        return {"rank": self.rank, "role": role}

    def _transfer_dense(self, op: _OpState) -> dict[str, Any]:
        plan = op.plan
        pairs = transfer_pairs(plan.old_size, plan.new_size)
        comm = op.eplb_comm
        assert comm is not None
        vec_len = self.model.dense_vector().numel()
        if self.rank in pairs:
            vec = self.model.dense_vector()
            comm.exchange([(vec, dst, 100 + dst) for dst in pairs[self.rank]], [])
            return {"sent_to": pairs[self.rank], "bytes": vec.numel() * vec.element_size() * len(pairs[self.rank])}
        for src, dsts in pairs.items():
            if self.rank in dsts:
                buf = torch.empty(vec_len, dtype=self.model.dtype, device=self.device)
                comm.exchange([], [(buf, src, 100 + self.rank)])
                self.model.load_dense_vector(buf)
                return {"received_from": src, "bytes": buf.numel() * buf.element_size()}
        return {}

    def request_commit(self, op_id: str) -> None:
        with self._lock:
            if self._op is None or self._op.plan.op_id != op_id:
                raise RuntimeError(f"no prepared operation {op_id} on rank {self.rank}")
            if not self._op.prepared.is_set():
                raise RuntimeError(f"operation {op_id} is not prepared on rank {self.rank}")
            self._commit_ready = True
            if self._op.role == "removing":
                self._set_state(RankState.REMOVING)
        self._poke()

    def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        op = self._op
        if op is None or op.plan.op_id != op_id:
            raise RuntimeError(f"no operation {op_id} on rank {self.rank}")
        if not op.done.wait(timeout_s):
            raise TimeoutError(f"rank {self.rank} did not finish {op_id} in {timeout_s:.0f}s (state {self.state.value})")
        if op.error:
            raise RuntimeError(op.error)
        return op.result

    def abort(self, op_id: str) -> bool:
        """Roll back a prepared-but-uncommitted operation: drop its groups, keep serving."""
        with self._lock:
            op = self._op
            if op is None or op.plan.op_id != op_id or self._commit_ready:
                return False
            self._op = None
            self.current_op = ""
        self._drop_op_groups(op)
        if self.state in (RankState.PREPARING, RankState.DRAINING):
            self._set_state(RankState.SERVING, f"{op_id} rolled back")
        return True

    @staticmethod
    def _drop_op_groups(op: _OpState) -> None:
        for g in (op.standby, op.eplb_comm):
            if g is not None:
                g.destroy()

    def _reshuffle(self, op: _OpState) -> dict[str, Any]:
        """Move expert weights into the new layout over the EPLB communicator."""
        plan = op.plan
        alive = set(range(plan.old_size))
        moves = plan_moves(plan.old_layout, plan.new_layout, alive)
        comm = op.eplb_comm
        assert comm is not None
        old_w1, old_w2 = self.model.w1.clone(), self.model.w2.clone()
        L = self.cfg.slots_per_rank

        def old_vec(slot: int) -> torch.Tensor:
            return torch.cat([old_w1[:, slot].reshape(-1), old_w2[:, slot].reshape(-1)])

        sends, recvs, local = [], [], []
        vec_len = old_vec(0).numel()
        for i, m in enumerate(moves):
            if m.local and m.dst_rank == self.rank:
                local.append(m)
            elif m.src_rank == self.rank and m.dst_rank != self.rank:
                sends.append((old_vec(m.src_slot), m.dst_rank, 1000 + i))
            elif m.dst_rank == self.rank and m.src_rank != self.rank:
                buf = torch.empty(vec_len, dtype=self.model.dtype, device=self.device)
                recvs.append((buf, m.src_rank, 1000 + i, m))
        comm.exchange(sends, [(b, s, t) for b, s, t, _ in recvs])
        for m in local:
            self.model.load_expert_vector(m.dst_slot, old_vec(m.src_slot))
        for buf, _, _, m in recvs:
            self.model.load_expert_vector(m.dst_slot, buf)
        assert L == plan.new_layout.slots_per_rank
        return {"moves_total": len(moves), "sent": len(sends), "received": len(recvs), "local": len(local)}

    def _commit(self) -> bool:
        """Runs on the step thread once every rank agreed: forward passes are paused here."""
        op = self._op
        assert op is not None
        plan = op.plan
        t0 = time.time()
        self._set_state(RankState.COMMITTING)
        try:
            with self.phase(plan.op_id, "commit", role=op.role) as d:
                if plan.kind == "scale_up":
                    self._switch(op)
                    self._receive_mapping(op, plan.new_layout)
                    with self.phase(plan.op_id, "reshuffle") as r:
                        r.update(self._reshuffle(op))
                    self.eplb.update_layout(plan.new_layout)
                    op.result.update(self.warm_and_capture(plan.op_id))
                elif op.role == "remaining":
                    with self.phase(plan.op_id, "reshuffle") as r:
                        r.update(self._reshuffle(op))
                    self._switch(op)
                    self.eplb.update_layout(plan.new_layout)
                    op.result.update(self.warm_and_capture(plan.op_id))
                else:  # removing: serve as a reshuffle source, hand back requests, leave
                    with self.phase(plan.op_id, "reshuffle") as r:
                        r.update(self._reshuffle(op))
                    with self._lock:
                        moved = self.sched.export_all()
                    op.result["moved"] = [dict(r.to_wire(), moved_from=r.moved_from + [self.rank]) for r in moved]
                    op.result["graphs_released"] = self.graphs.release()
                    self._drop_op_groups(op)
                    if self.group is not None:
                        self.group.destroy()
                    self.group = None
                d["pause_s"] = time.time() - t0
            op.result["pause_s"] = time.time() - t0
        except Exception as e:
            op.error = f"commit failed on rank {self.rank}: {type(e).__name__}: {e}"
            self._fail(e)
            op.done.set()
            return False
        with self._lock:
            self._commit_ready = False
            self.current_op = ""
            if op.role == "removing":
                self._stop = True
        if op.role == "removing":
            self._set_state(RankState.REMOVED, f"removed by {plan.op_id}")
            op.done.set()
            return False
        self._set_state(RankState.SERVING)
        op.done.set()
        return True

    def _switch(self, op: _OpState) -> None:
        """Adopt the standby group as the live DP/EP group and the new layout (I6)."""
        old = self.group
        with self._lock:
            self.group = op.standby
            self._wake_idx = 0
        if old is not None and old is not op.standby:
            old.destroy()
        self.model.set_layout(op.plan.new_layout, self.rank)

    def _receive_mapping(self, op: _OpState, layout: ExpertLayout) -> None:
        """Rank 0 broadcasts the expert mapping; joining ranks learn it, others confirm it."""
        t = torch.tensor(layout.phys_to_logical, dtype=torch.int64)
        self.group.broadcast(t, 0)  # type: ignore[union-attr]
        if tuple(t.tolist()) != layout.phys_to_logical:
            raise RuntimeError("expert mapping from rank 0 differs from the plan")

    def _join_commit_then_serve(self) -> None:
        op = self._op
        assert op is not None
        self.eplb.async_started = False
        if not self._commit():
            return
        self.eplb.async_started = True  # joining ranks start EPLB's work only at commit (I2)
        self._loop()

    # ---- shutdown and failure ---------------------------------------------------------------
    def _fail(self, e: BaseException) -> None:
        self._set_state(RankState.FAILED, f"{type(e).__name__}: {e}")
        now = time.time()
        ev = Event(self.current_op or "serving", self.rank, "failure", now, now, "error",
                   {"error": str(e), "traceback": traceback.format_exc()[-2000:]}).to_dict()
        self.events.append(ev)
        with contextlib.suppress(Exception):
            self.sink("event", ev)
        # Requests on a failed rank cannot finish here: report them as failed.
        with self._lock:
            pending = list(self.sched.running) + list(self.sched.waiting)
        if pending:
            with contextlib.suppress(Exception):
                self.sink("results", {"results": [dict(r.to_wire(), rank=self.rank, error=str(e)) for r in pending]})

    def stop(self) -> None:
        self._stop = True
        self._poke()
        if self.group is not None:
            self.group.destroy()
