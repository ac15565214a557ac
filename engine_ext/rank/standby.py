"""The rank side of a standby: launched ahead (torch imported, model and KV allocated, store
reachable), in no DP group and serving nothing, under the identity ``<deployment>_standby<N>``
(I1: never a ``_dp<r>`` another rank may hold); ``adopt`` gives it a DP rank and re-bases its
identity to ``_dp<rank>`` when a scale-up takes it from the pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.identity import apply_dp_identity_suffix, standby_identity
from engine_ext.protocol import RankState

if TYPE_CHECKING:
    from engine_ext.rank.engine import RankEngine

def enter_standby(engine: RankEngine, n: int) -> None:
    """Name the rank ``<base>_standby<n>`` and report it idle in the pool."""
    cfg = engine.cfg
    engine.standby_identity_base = (cfg.instance_id, cfg.kv_transfer.engine_id)  # suffixed: adopt re-bases
    cfg.instance_id = standby_identity(cfg.instance_id, n)  # the identity base: the deployment under eepctl
    if cfg.kv_transfer.engine_id:
        cfg.kv_transfer.engine_id = standby_identity(cfg.kv_transfer.engine_id, n)
    engine.telemetry.set_state(RankState.STANDBY, f"standby {n}: launched ahead, in no DP group")


def adopt(engine: RankEngine, rank: int, layout: ExpertLayout) -> None:
    """Become DP rank ``rank`` (a joiner of the next scale-up): identity re-based to ``_dp<rank>``."""
    if engine.state != RankState.STANDBY:
        raise RuntimeError(f"rank {engine.rank} is {engine.state.value}, not standby: it cannot be adopted")
    engine.cfg.instance_id, engine.cfg.kv_transfer.engine_id = engine.standby_identity_base
    apply_dp_identity_suffix(engine.cfg, rank)
    with engine.lock:
        engine.rank = rank
        engine.faults.rank = rank
        engine.model.set_layout(layout, rank)
        engine.eplb.layout = layout
    engine.telemetry.set_state(RankState.STARTING, f"taken from the standby pool as rank {rank}")
