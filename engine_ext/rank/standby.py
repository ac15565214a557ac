"""The rank side of a standby: launched ahead (torch imported, model and KV allocated, store
reachable), in no DP group and serving nothing, under the identity ``<deployment>_standby<N>``
(I1: never a ``_dp<r>`` another rank may hold); ``adopt`` gives it a DP rank and re-bases its
identity to ``_dp<rank>`` when a scale-up takes it from the pool."""

from __future__ import annotations

from typing import Protocol

from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.identity import apply_dp_identity_suffix, standby_identity
from engine_ext.protocol import RankState
from engine_ext.rank.shared import RankResources, RankShared
from engine_ext.rank.telemetry import RankTelemetry
from engine_ext.rank.warmup import Warmup


class StandbyIdentity:
    """A standby rank's identity while in the pool, and its adoption as a DP rank."""

    def __init__(self, res: RankResources, shared: RankShared, telemetry: RankTelemetry) -> None:
        self.res = res
        self.shared = shared
        self.telemetry = telemetry
        self.base: tuple[str, str] = ("", "")  # the suffixed identity at launch: adopt re-bases it

    def enter(self, n: int) -> None:
        """Name the rank ``<base>_standby<n>`` and report it idle in the pool."""
        cfg = self.res.cfg
        self.base = (cfg.instance_id, cfg.kv_transfer.engine_id)
        cfg.instance_id = standby_identity(cfg.instance_id, n)  # the identity base: the deployment under eepctl
        if cfg.kv_transfer.engine_id:
            cfg.kv_transfer.engine_id = standby_identity(cfg.kv_transfer.engine_id, n)
        self.telemetry.set_state(RankState.STANDBY, f"standby {n}: launched ahead, in no DP group")

    def adopt(self, rank: int, layout: ExpertLayout) -> None:
        """Become DP rank ``rank`` (a joiner of the next scale-up): identity re-based to ``_dp<rank>``."""
        shared, res = self.shared, self.res
        if shared.state != RankState.STANDBY:
            raise RuntimeError(f"rank {shared.rank} is {shared.state.value}, not standby: it cannot be adopted")
        res.cfg.instance_id, res.cfg.kv_transfer.engine_id = self.base
        apply_dp_identity_suffix(res.cfg, rank)
        with shared.lock:
            shared.rank = rank
            res.faults.rank = rank
            res.model.set_layout(layout, rank)
            res.eplb.layout = layout
        self.telemetry.set_state(RankState.STARTING, f"taken from the standby pool as rank {rank}")
        res.faults.hold("adopt")


class StandbyHost(Protocol):
    """What the hosts hand ``enter_standby``: a rank that has a standby identity and a warm-up."""

    standby: StandbyIdentity
    warmup: Warmup


def enter_standby(engine: StandbyHost, n: int) -> None:
    """Put a rank just launched for the standby pool under its standby identity (the hosts call
    this); under ``reuse`` it then warms up and captures in the pool (``Warmup.capture_in_pool``)."""
    engine.standby.enter(n)
    engine.warmup.capture_in_pool()
