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


def test_wait_op_answers_an_abandoned_operations_error_and_a_rolled_back_one_at_once():
    """A commit that fails marks the rank failed, and the reconcile loop's fence abandons its
    operation; a controller's ``wait_op`` that arrives after that gets the commit's error (it got
    "no operation" before: a busy box's CI run); a rolled-back operation answers at once."""
    from types import SimpleNamespace

    from engine_ext.rank.operation import OpState
    from engine_ext.rank.shared import RankShared
    from engine_ext.rank.transition import RankTransition

    shared = RankShared(0)
    rank = RankTransition(None, shared, None, None, None, None, lambda ex: None)  # wait_op and abort read ``shared``
    failed = OpState(SimpleNamespace(op_id="op-failed"), "remaining")
    shared.begin_op("op-failed", failed)
    failed.error = "commit failed on rank 0: WorkspaceSizeError: 1024 bytes locked, 2048 bytes needed"
    failed.done.set()
    assert shared.take_op() is failed  # the fence
    with pytest.raises(RuntimeError, match="WorkspaceSizeError"):
        rank.wait_op("op-failed", 1.0)
    with pytest.raises(RuntimeError, match="no operation op-other on rank 0"):
        rank.wait_op("op-other", 1.0)
    prepared = OpState(SimpleNamespace(op_id="op-rolled"), "existing")
    shared.begin_op("op-rolled", prepared)
    assert rank.abort("op-rolled")
    with pytest.raises(RuntimeError, match="op-rolled rolled back"):
        rank.wait_op("op-rolled", 30.0)  # at once, not after the 30 s
