"""One DP rank of the reference engine: it builds the rank's parts and implements ``RankControl``.

The parts are collaborating objects, one concept each: ``StepLoop`` (serving), ``Warmup``
(warm-up and capture, under either capture policy), ``RankTransition`` (the rank side of a
transition), ``RankRecovery`` (degrade on a peer's death, rebuild on a recovery plan),
``ExpertReshuffle`` (expert moves), ``StandbyIdentity`` and ``RankTelemetry`` (events,
heartbeat). None of them sees this class: each gets ``RankResources`` (what the rank computes
with), ``RankShared`` (the state its threads share, with its lock discipline) and the few
collaborators it calls (engine_ext/rank/shared.py). ``Faults`` is the one seam tests break it
through. Ray-free: the Ray actor (engine_ext.ray.rank_actor) and the process launcher
(engine_ext.launcher) both drive this class, so hosts without Ray run the same code.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from engine_ext.config import EngineConfig
from engine_ext.elastic.comm import StatelessGroup
from engine_ext.elastic.eplb import EplbState, ExpertLayout
from engine_ext.elastic.graphs import GraphManager
from engine_ext.elastic.identity import apply_dp_identity_suffix
from engine_ext.elastic.netaddr import local_ip
from engine_ext.elastic.rendezvous import Rendezvous
from engine_ext.elastic.stores import configure_node, host_store
from engine_ext.elastic.transition_plan import TransitionPlan
from engine_ext.elastic.weight_source import WeightSource
from engine_ext.elastic.workspace import WorkspaceManager
from engine_ext.errors import RankRefused
from engine_ext.faults import Faults
from engine_ext.model.model import PLACEHOLDER_SEED_OFFSET, MoEModel
from engine_ext.model.seeded_source import SeededWeightSource
from engine_ext.protocol import RankState, RankStatus, to_builtins
from engine_ext.rank.capture_reuse import CaptureReuse, max_world_handle
from engine_ext.rank.device_info import device_uuid, mps_active
from engine_ext.rank.recovery import RankRecovery
from engine_ext.rank.reshuffle import ExpertReshuffle
from engine_ext.rank.scheduler import Request, RequestRejected, Scheduler
from engine_ext.rank.shared import RankResources, RankShared
from engine_ext.rank.standby import StandbyIdentity
from engine_ext.rank.status_fields import eplb_fields, graph_fields, process_rss_bytes, scheduler_fields
from engine_ext.rank.step_loop import StepLoop
from engine_ext.rank.telemetry import RankTelemetry, Sink
from engine_ext.rank.transition import RankTransition
from engine_ext.rank.warmup import Warmup
from engine_ext.records import Refusal

# The states in which a rank takes no requests, and the code its refusal carries. A draining
# rank still takes what reaches it (the router sends it nothing new).
_REFUSING = {
    RankState.FAILED: Refusal.FAILED,
    RankState.REMOVED: Refusal.REMOVED,
    RankState.REMOVING: Refusal.REMOVING,
    RankState.DEGRADED: Refusal.DEGRADED,
    RankState.RECOVERING: Refusal.RECOVERING,
    RankState.FENCED: Refusal.FENCED,
}


def rank_identity(cfg: EngineConfig, deployment: str, rank: int, faults: Faults) -> EngineConfig:
    """``cfg`` with the rank's identity: instance and KV engine id ``<base>_dp<rank>`` (I1)."""
    if not cfg.instance_id:
        cfg.instance_id = deployment
    if not cfg.kv_transfer.engine_id:
        cfg.kv_transfer.engine_id = f"{deployment}-kv"
    if faults.active("no_suffix"):  # the suffix switched off: every rank claims the base identity
        return cfg
    if faults.active("double_suffix"):  # upstream's bug, built by hand: a second layer suffixed again
        cfg.instance_id = f"{cfg.instance_id}_dp{rank}_dp{rank}"
        cfg.kv_transfer.engine_id = f"{cfg.kv_transfer.engine_id}_dp{rank}_dp{rank}"
        return cfg
    return apply_dp_identity_suffix(cfg, rank)


class RankEngine:
    """Implements ``engine_ext.control.rank_client.RankControl``; builds the rank's parts and
    hands each the few things it needs (``RankResources``, ``RankShared``, its collaborators)."""

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
        self.shared = shared = RankShared(rank)
        faults = Faults(cfg.faults, cfg.fault_delay_s, rank, on_hold=self._on_hold, joining=joining)
        self.cfg = cfg = rank_identity(cfg, deployment, rank, faults)
        self.deployment, self.kind = deployment, kind
        self.device = torch.device(device)
        self.device_uuid, self.mps = device_uuid(self.device), mps_active(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, int(os.environ.get("EEP_TORCH_THREADS", "1"))))
        self.node = socket.gethostname()
        # Ray ranks bind and advertise the node IP Ray reports (or the operator's interface);
        # the process launcher (one node, no Ray) keeps the default-route guess.
        self.node_id = node_id
        self.ip = configure_node(node_ip, ifname).ip if (node_ip or ifname) else local_ip()
        self._store_master: Any = None
        handle = max_world_handle(cfg, faults, shared)  # None under the default recapture policy
        # What a capture is bound to, set here once: the live group, or the max-world handle.
        self.res = res = self._resources(
            cfg, layout, joining, faults, handle.world_key if handle is not None else shared.world_key
        )
        self.telemetry = telemetry = RankTelemetry(shared, sink, self.status)
        reuse = CaptureReuse(handle, res, shared, telemetry) if handle is not None else None
        self.warmup = Warmup(res, shared, telemetry, reuse)
        reshuffle = ExpertReshuffle(res, shared, weight_source or SeededWeightSource(cfg), self.warmup.kv_pool_blocks)
        self.loop = StepLoop(res, shared, telemetry)
        self.recovery = RankRecovery(res, shared, telemetry, self.loop, self.warmup, reshuffle)
        self.transition = RankTransition(
            res, shared, telemetry, self.loop, self.warmup, reshuffle, self.recovery.on_error
        )
        self.loop.wire(commit=self.transition.commit, on_error=self.recovery.on_error)
        self.standby = StandbyIdentity(res, shared, telemetry)
        faults.hold("launch")

    def _resources(
        self,
        cfg: EngineConfig,
        layout: ExpertLayout,
        joining: bool,
        faults: Faults,
        world_key: Callable[[], tuple[int, int]],
    ) -> RankResources:
        """Model, workspace, graphs, scheduler and EPLB state of this rank (a joiner's model
        holds placeholder weights until its transition moves the real ones)."""
        rank, device = self.shared.rank, self.device
        seed = cfg.seed + PLACEHOLDER_SEED_OFFSET + rank if joining else cfg.seed
        model = MoEModel(cfg, layout, rank, device, seed)
        workspace = WorkspaceManager(device)
        graphs = GraphManager(device, workspace, model.buffers, world_key)
        graphs.verify = not faults.active("no_stale_check")
        return RankResources(
            cfg=cfg,
            device=device,
            model=model,
            workspace=workspace,
            graphs=graphs,
            sched=Scheduler(cfg),
            eplb=EplbState(layout, async_started=not joining),
            faults=faults,
        )

    def _on_hold(self, phase: str) -> None:
        self.shared.state_reason = f"held in {phase} by a test fault"
        self.telemetry.publish()

    # ---- identity and the parts' state, read-only -----------------------------------------------
    @property
    def rank(self) -> int:
        return self.shared.rank

    @property
    def instance_id(self) -> str:
        return self.cfg.instance_id

    @property
    def engine_id(self) -> str:
        return self.cfg.kv_transfer.engine_id

    @property
    def world_size(self) -> int:
        """Read live from the current group (I6): never cached from construction."""
        return self.shared.world_size

    @property
    def state(self) -> RankState:
        return self.shared.state

    @property
    def stale_replays_refused(self) -> int:
        return self.shared.stale_replays_refused

    @property
    def model(self) -> MoEModel:
        return self.res.model

    @property
    def graphs(self) -> GraphManager:
        return self.res.graphs

    @property
    def workspace(self) -> WorkspaceManager:
        return self.res.workspace

    @property
    def sched(self) -> Scheduler:
        return self.res.sched

    @property
    def eplb(self) -> EplbState:
        return self.res.eplb

    # ---- RankControl: telemetry ---------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        shared, res = self.shared, self.res
        now = time.time()
        rss = process_rss_bytes()
        st = RankStatus(
            deployment=self.deployment,
            rank=shared.rank,
            instance_id=self.instance_id,
            engine_id=self.engine_id,
            kind=self.kind,
            node=f"{self.node}/{self.ip}",
            node_id=self.node_id,
            node_ip=self.ip,
            pid=os.getpid(),
            device=str(self.device),
            device_uuid=self.device_uuid,
            mps=self.mps,
            state=shared.state.value,
            state_reason=shared.state_reason,
            dp_size=shared.world_size,
            workspace_bytes=res.workspace.nbytes,
            workspace_locked=res.workspace.locked,
            workspace_required_bytes=shared.required_workspace,
            capture_policy=self.cfg.capture_policy,
            workspace_recapture_bytes=res.model.moe_workspace_bound(shared.world_size),
            captures_this_op=shared.capture_passes,
            current_op=shared.current_op,
            steps=shared.steps,
            last_heartbeat=now,
            epoch=shared.epoch,
            transport=getattr(shared.group, "transport_kind", ""),
            transport_attached=getattr(shared.group, "transport_attached", 0),
            stale_replays_refused=shared.stale_replays_refused,
            capture_sizes_expected=list(self.cfg.capture_sizes),
            move_bytes_held=shared.move_bytes_held,
            rss_bytes=rss,
            memory_bytes=rss,  # the rank is one process
            **scheduler_fields(res.sched, now),
            **graph_fields(res.graphs),
            **eplb_fields(res.eplb, res.model.rank),  # the layout slice at the model's position
        )
        return to_builtins(st)

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
        self.shared.set_group(
            StatelessGroup(
                rdzv.child("dp"),
                self.rank,
                world_size,
                timeout_s=timeout_s,
                backend=self.cfg.backend,
                device=self.device,
                transport=self.cfg.transport,
                shm_bytes=self.res.model.exchange_bound(world_size),
            )
        )
        self.res.eplb.layout = self.res.model.layout

    def warm_and_capture(self, op_id: str) -> dict[str, Any]:
        """Runs in lockstep on every rank of the current group (I4, I5, I7)."""
        return self.warmup.warm_and_capture(op_id)

    def serve(self) -> None:
        self.telemetry.set_state(RankState.SERVING)
        self.loop.start()

    def add_request(self, wire: dict[str, Any]) -> None:
        """Queue a request, or raise RankRefused with the code the router decides on. The state is
        read under the lock the request is queued under: a removing rank turns REMOVING and hands
        its requests back under it, so a request either is handed back or is refused (read before
        it, a request that came in meanwhile was queued after the hand-back and never answered)."""
        shared = self.shared
        req = Request.from_wire(wire)
        with shared.lock:
            code = _REFUSING.get(shared.state) or (Refusal.STOPPED if shared.stopping else None)
            if code is None:
                try:
                    self.res.sched.add(req)
                except RequestRejected as e:  # beyond the model's limits: final, on every rank
                    raise RankRefused(str(e), Refusal.INVALID) from None
        if code is not None:
            raise RankRefused(
                f"rank {shared.rank} is {code.value} and takes no requests"
                + (f": {shared.state_reason}" if shared.state_reason else ""),
                code,
            )
        self.loop.poke()

    def give_back_waiting(self, keep: int) -> list[dict[str, Any]]:
        """Hand back the requests still waiting beyond the first ``keep`` (admitted, not yet
        prefilled), for the router to send on (a scale-up's joiners take them). Taken under the
        lock the step loop schedules under: a request is either given back or prefilled here,
        never both. A rank that is not serving keeps what it holds and gives back nothing."""
        shared = self.shared
        with shared.lock:
            if shared.state is not RankState.SERVING or shared.stopping:
                return []
            given = self.res.sched.give_back(keep)
        if given:
            self.res.faults.hold("give_back")
        return [r.to_wire() for r in given]

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
        self.standby.adopt(rank, ExpertLayout.from_dict(layout_d))

    def fence(self, epoch: int, reason: str) -> None:
        """The controller excluded this rank at ``epoch`` (it hung, failed or was cut off) and
        the world moved on without it: stop stepping, drop the groups, serve nothing more."""
        self.recovery.fence(f"fenced at epoch {epoch}: {reason}")

    # ---- shutdown ---------------------------------------------------------------------------------
    def stop(self) -> None:
        self.shared.stop()
        self.loop.poke()
        group = self.shared.group
        if group is not None:
            group.destroy()
