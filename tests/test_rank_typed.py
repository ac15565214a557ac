"""A rank's refusal and a peer's failure are typed: codes survive the transports, and the
classification reads exception types and the transport's code, not message words."""

from __future__ import annotations

import pickle

import pytest

from engine_ext.errors import RankRefused, refusal_of
from engine_ext.records import Refusal


def test_refusal_code_survives_the_pipe_and_a_wrapping_error():
    refused = RankRefused("rank 1 is degraded and takes no requests", Refusal.DEGRADED)
    back = pickle.loads(pickle.dumps(refused))  # the process launcher's pipe pickles it
    assert isinstance(back, RankRefused) and back.code is Refusal.DEGRADED and str(back) == str(refused)
    wrapper = RuntimeError("RankCallError: ...")
    wrapper.__cause__ = back
    assert refusal_of(wrapper) is Refusal.DEGRADED

    class RayLike(Exception):  # Ray's RayTaskError keeps the original as ``cause``
        cause = back

    assert refusal_of(RayLike()) is Refusal.DEGRADED
    assert refusal_of(RuntimeError("rank 1 is degraded and takes no requests")) is None
    assert Refusal.RECOVERING.recovery_coming and not Refusal.FAILED.recovery_coming


def test_peer_failure_is_read_from_types_and_the_transport_code():
    import torch.distributed as dist

    from engine_ext.elastic.comm import GroupError, GroupFailure
    from engine_ext.rank.recovery import is_peer_failure

    assert is_peer_failure(GroupError(GroupFailure.PEER_GONE, "exchange: connection reset"))
    assert is_peer_failure(dist.DistNetworkError("store gone"))
    assert is_peer_failure(ConnectionResetError()) and is_peer_failure(TimeoutError())
    wrapped = RuntimeError("commit failed")
    wrapped.__cause__ = GroupError(GroupFailure.ABORTED, "destroyed")
    assert is_peer_failure(wrapped)
    # Words alone are not a peer failure: "restore" contains "store", "socket" is just a word.
    assert not is_peer_failure(RuntimeError("could not restore expert 3 from the weight source"))
    assert not is_peer_failure(ValueError("socket count must be positive"))


def test_a_destroyed_group_fails_its_collectives_as_aborted():
    import torch

    from engine_ext.elastic.comm import GroupError, GroupFailure, StatelessGroup

    group = StatelessGroup.__new__(StatelessGroup)  # no rendezvous: only the failure path is under test
    group.pg = None
    group.rdzv = type("R", (), {"prefix": "test/dp"})()
    with pytest.raises(GroupError) as ei:
        group.all_reduce_max(torch.zeros(1))
    assert ei.value.code is GroupFailure.ABORTED
