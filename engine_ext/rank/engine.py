"""One DP rank of the reference engine: the state its parts share, and ``RankControl``.

The parts are collaborating objects, one concept each: ``StepLoop`` (serving),
``Warmup`` (warm-up and capture), ``RankTransition`` (the rank side of a transition) and
``RankTelemetry`` (status, events, heartbeat); ``Faults`` is the one seam tests break it
through. Ray-free: the Ray actor (engine_ext.ray.rank_actor) and the process launcher
(engine_ext.launcher) both drive this class, so hosts without Ray run the same code.
"""

from __future__ import annotations

import copy
import os
import socket
import threading
from typing import Any

import torch

from engine_ext.elastic.comm import StatelessGroup, configure_node, host_store, local_ip
from engine_ext.elastic.eplb import EplbState, ExpertLayout
from engine_ext.elastic.graphs import GraphManager
from engine_ext.elastic.identity import apply_dp_identity_suffix
from engine_ext.elastic.rendezvous import Rendezvous
from engine_ext.elastic.transition_plan import TransitionPlan
from engine_ext.elastic.weight_source import WeightSource
from engine_ext.elastic.workspace import WorkspaceManager
from engine_ext.config import EngineConfig
from engine_ext.rank.faults import Faults
from engine_ext.model.model import PLACEHOLDER_SEED_OFFSET, MoEModel
from engine_ext.model.seeded_source import SeededWeightSource
from engine_ext.rank.telemetry import RankTelemetry, Sink
from engine_ext.rank.recovery import RankRecovery
from engine_ext.rank.scheduler import Request, Scheduler
from engine_ext.rank.step_loop import StepLoop
from engine_ext.rank.transition import RankTransition
from engine_ext.rank import standby as standby_rank
from engine_ext.rank.capture_reuse import reuse_for
from engine_ext.rank.warmup import Warmup
from engine_ext.protocol import RankState


class RankEngine:
    """Implements ``engine_ext.control.rank_client.RankControl``."""

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
        weight_source: WeightSource | None = None,
    ) -> None:
        cfg = copy.deepcopy(cfg)
        cfg.validate()
        self.faults = Faults(cfg.faults, cfg.fault_delay_s, rank, on_hold=self._on_hold)
        if not cfg.instance_id:
            cfg.instance_id = deployment
        if not cfg.kv_transfer.engine_id:
            cfg.kv_transfer.engine_id = f"{deployment}-kv"
        if self.faults.active("double_suffix"):  # stacks suffixes (the upstream bug)
            cfg.instance_id = f"{cfg.instance_id}_dp{rank}_dp{rank}"
            cfg.kv_transfer.engine_id = f"{cfg.kv_transfer.engine_id}_dp{rank}_dp{rank}"
        elif not self.faults.active("no_suffix"):  # no_suffix: every rank claims the base identity
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
        # Where experts whose every copy died come from: a checkpoint loader in production.
        self.weight_source: WeightSource = weight_source or SeededWeightSource(cfg)
        self.workspace = WorkspaceManager(self.device)
        self.graphs = GraphManager(self.device, self.workspace, self.model.buffers)
        self.sched = Scheduler(cfg)
        self.eplb = EplbState(layout, async_started=not joining)
        self.required_workspace = 0
        self.group: StatelessGroup | None = None
        self.state = RankState.STARTING
        self.state_reason = ""
        self.steps = 0
        self.stale_replays_refused = 0
        self.capture_passes = 0  # capture passes in the current operation (I4: exactly one)
        self.current_op = ""
        self.stopping = False
        self.halting = False  # a peer died: the step loop stops until recovery resumes it
        self.lock = threading.RLock()
        self.node = socket.gethostname()
        # Ray ranks bind and advertise the node IP Ray reports (or the operator's interface);
        # the process launcher (one node, no Ray) keeps the default-route guess.
        self.node_id = node_id
        self.ip = configure_node(node_ip, ifname).ip if (node_ip or ifname) else local_ip()
        self._store_master: Any = None
        self.telemetry = RankTelemetry(self, sink)
        self.loop = StepLoop(self)
        self.warmup = Warmup(self)
        self.capture_reuse = reuse_for(self)  # None under the default recapture policy
        self.transition = RankTransition(self)
        self.recovery = RankRecovery(self)
        self.faults.hold("launch")

    def _on_hold(self, phase: str) -> None:
        self.state_reason = f"held in {phase} by a test fault"
        self.telemetry.publish()

    # ---- identity ---------------------------------------------------------------------------------
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

    # ---- RankControl: telemetry ---------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self.telemetry.status()

    def recent_events(self) -> list[dict[str, Any]]:
        return self.telemetry.recent_events()

    def start_heartbeat(self, interval_s: float = 1.0) -> None:
        self.telemetry.start_heartbeat(interval_s)

    # ---- RankControl: membership, warm-up, serving ---------------------------------------------------
    def host_store(self) -> tuple[str, int]:
        """Rank 0 hosts the deployment's TCPStore (a survivor hosts a new one when the host
        died); every rendezvous is a prefix in it."""
        if self._store_master is None:
            self._store_master = host_store()
        return self.ip, int(self._store_master.port)

    def join(self, rdzv: Rendezvous, world_size: int, timeout_s: float = 120.0) -> None:
        self.group = StatelessGroup(rdzv.child("dp"), self.rank, world_size, timeout_s=timeout_s,
                                    backend=self.cfg.backend, device=self.device)
        self.eplb.layout = self.model.layout
        self.loop.reset_wake()

    def warm_and_capture(self, op_id: str) -> dict[str, Any]:
        """Runs in lockstep on every rank of the current group (I4, I5, I7)."""
        return self.warmup.warm_and_capture(op_id)

    def serve(self) -> None:
        self.telemetry.set_state(RankState.SERVING)
        self.loop.start()

    def add_request(self, wire: dict[str, Any]) -> None:
        if self.state in (RankState.FAILED, RankState.REMOVED, RankState.REMOVING, RankState.DEGRADED,
                          RankState.RECOVERING) or self.stopping:
            raise RuntimeError(f"rank {self.rank} is {self.state.value} and takes no requests"
                               + (f": {self.state_reason}" if self.state_reason else ""))
        req = Request.from_wire(wire)
        with self.lock:
            self.sched.add(req)
        self.loop.poke()

    # ---- RankControl: transitions -------------------------------------------------------------------
    def prepare(self, plan: TransitionPlan) -> dict[str, Any]:
        return self.transition.prepare(plan)

    def begin_drain(self, op_id: str) -> None:
        self.transition.begin_drain(op_id)

    def request_commit(self, op_id: str) -> None:
        self.transition.request_commit(op_id)

    def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        return self.transition.wait_op(op_id, timeout_s)

    def abort(self, op_id: str) -> bool:
        return self.transition.abort(op_id)

    def recover(self, plan: TransitionPlan) -> dict[str, Any]:
        return self.recovery.recover(plan)

    def adopt(self, rank: int, layout_d: dict[str, Any]) -> None:
        standby_rank.adopt(self, rank, ExpertLayout.from_dict(layout_d))

    # ---- shutdown and failure -----------------------------------------------------------------------
    def fail(self, e: BaseException) -> None:
        """The rank cannot go on: say why, and report its requests as failed."""
        self.telemetry.set_state(RankState.FAILED, f"{type(e).__name__}: {e}")
        self.telemetry.failure(self.current_op or "serving", e)
        with self.lock:
            pending = list(self.sched.running) + list(self.sched.waiting)
        if pending:
            self.telemetry.send("results", {"results": [dict(r.to_wire(), rank=self.rank, error=str(e))
                                                        for r in pending]})

    def stop(self) -> None:
        self.stopping = True
        self.loop.poke()
        if self.group is not None:
            self.group.destroy()
