"""The shared-memory transport of the per-step collectives (engine_ext/transport/shm.py).

Real processes and real groups: the ranks are spawned processes that form ``StatelessGroup``s
over a real TCPStore; faults are real (SIGKILL, SIGSTOP by pid). Runs under the deployment lock.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

from engine_ext.config import EngineConfig
from engine_ext.elastic.comm import GroupError, GroupFailure, StatelessGroup
from engine_ext.elastic.rendezvous import Rendezvous
from engine_ext.elastic.stores import host_store
from engine_ext.transport import cuda_ipc, shm_files
from engine_ext.transport import shm as shm_transport

pytestmark = pytest.mark.skipif(not shm_transport.supported(), reason="the shm transport needs x86-64 store order")

CTX = mp.get_context("spawn")


def _segments() -> set[str]:
    return {n for n in os.listdir(shm_files.shm_dir()) if n.startswith("eepctl-")}


def _collectives(
    rank: int, size: int, port: int, prefix: str, transport: str, node_ip: str, device: str, q: Any
) -> None:
    """Every collective the serving step uses, on float64 and int64, and the expert moves'
    point-to-point exchange, reported back."""
    from engine_ext.elastic import stores

    if node_ip:
        stores.configure_node(node_ip)
    dev = torch.device(device)
    g = StatelessGroup(
        Rendezvous("127.0.0.1", port, prefix), rank, size, transport=transport, shm_bytes=4096, device=dev
    )
    mx = g.all_reduce_max(torch.tensor([rank, 10 - rank, 3], dtype=torch.int64, device=dev)).tolist()
    sm = g.all_reduce_sum(torch.arange(4, dtype=torch.float64, device=dev) * (rank + 1)).tolist()
    outs = [torch.empty(3, dtype=torch.float64, device=dev) for _ in range(size)]
    g.all_gather(outs, torch.full((3,), float(rank), dtype=torch.float64, device=dev) + torch.arange(3, device=dev))
    out = torch.empty(2, dtype=torch.float64, device=dev)
    g.reduce_scatter(out, list((torch.arange(2 * size, dtype=torch.float64, device=dev) + 100 * rank).chunk(size)))
    # The MoE dispatch's all-to-all: uneven rows (some none) to each rank, a second one back.
    counts = [(rank * j + j) % 3 for j in range(size)]
    send = torch.tensor(
        [[100 * rank + 10 * j + i, -1.0] for j in range(size) for i in range(counts[j])],
        dtype=torch.float64,
        device=dev,
    ).reshape(-1, 2)
    got: list[torch.Tensor] = []
    rc = g.all_to_all_v(
        send, counts, lambda n: got.append(torch.empty(n, 2, dtype=torch.float64, device=dev)) or got[-1]
    )
    back = torch.empty_like(send)
    g.all_to_all_v(got[0] * 2, rc, lambda n: back[:n], counts)
    for _ in range(50):  # more generations than the two buffers: reuse must wait for the readers
        g.all_reduce_sum(torch.ones(8, device=dev))
    moved = []  # the reshuffle's moves: pieces of a live "weights" tensor to the next rank
    weights = torch.arange(1000, dtype=torch.float32, device=dev) + 1000 * rank
    for _ in range(2):  # a second exchange meets the second of the pair
        into = [torch.zeros(10, device=dev), torch.zeros(2, 25, device=dev)]
        g.exchange(
            [(weights[10:20], (rank + 1) % size, 7), (weights[100:150].view(2, 25), (rank + 1) % size, 8)],
            [(into[0], (rank - 1) % size, 7), (into[1], (rank - 1) % size, 8)],
        )
        moved.append([into[0].tolist(), into[1][1].tolist()])
    q.put(
        {
            "rank": rank,
            "kind": g.transport_kind,
            "attached": g.transport_attached,
            "max": mx,
            "sum": sm,
            "gather": [o.tolist() for o in outs],
            "rs": out.tolist(),
            "a2a": got[0][:, 0].tolist(),
            "a2a_counts": rc,
            "a2a_back": torch.equal(back, send * 2),
            "moved": moved,
            "pid": os.getpid(),
        }
    )
    g.barrier()
    g.destroy()


def _spawn(target: Any, size: int, extra: Any) -> tuple[list[Any], Any, Any]:
    store = host_store("127.0.0.1")
    q = CTX.Queue()
    procs = [CTX.Process(target=target, args=(r, size, store.port, *extra(r), q)) for r in range(size)]
    for p in procs:
        p.start()
    return procs, q, store


def _results(
    size: int, prefix: str, transport: str, node_ips: list[str] | None = None, device: str = "cpu"
) -> list[dict]:
    procs, q, _store = _spawn(_collectives, size, lambda r: (prefix, transport, (node_ips or [""] * size)[r], device))
    got = sorted((q.get(timeout=120) for _ in range(size)), key=lambda d: d["rank"])
    for p in procs:
        p.join(30)
    return got


def test_shm_collectives_equal_gloo_and_leave_no_segment() -> None:
    before = _segments()
    shm, gloo = _results(3, "eq-shm", "auto"), _results(3, "eq-gloo", "gloo")
    assert [r["kind"] for r in shm] == ["shm"] * 3 and [r["attached"] for r in shm] == [3] * 3
    assert [r["kind"] for r in gloo] == ["gloo"] * 3 and [r["attached"] for r in gloo] == [0] * 3
    for a, b in zip(shm, gloo, strict=True):
        assert {k: v for k, v in a.items() if k not in ("kind", "attached", "pid")} == {
            k: v for k, v in b.items() if k not in ("kind", "attached", "pid")
        }
    assert shm[0]["max"] == [2, 10, 3] and shm[1]["rs"] == [3 * 2 + 300, 3 * 3 + 300]
    assert shm[1]["a2a_counts"] == [1, 2, 0] and shm[1]["a2a"] == [10, 110, 111] and all(r["a2a_back"] for r in shm)
    prev = 1000 * 2  # rank 0's moves came from rank 2's "weights", through a shared-memory file each
    assert shm[0]["moved"] == [[[prev + i for i in range(10, 20)], [prev + i for i in range(125, 150)]]] * 2
    # rank 0 unlinked the name once every rank had mapped it (a segment is named by its creator's pid;
    # another test running beside this one may hold its own)
    ours = {r["pid"] for r in shm + gloo}
    assert [n for n in _segments() - before if int(n.split("-")[1]) in ours] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU runs cover shm)")
def test_cuda_ipc_collectives_and_moves_equal_gloo_on_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ranks on one GPU: device buffers through CUDA IPC give gloo's results (gloo has no
    device reduce-scatter, so the CPU run is the reference), and a move reads the sender's storage."""
    monkeypatch.delenv(cuda_ipc.ENABLE_ENV, raising=False)  # the default (the spawned ranks inherit it)
    ipc, gloo = _results(3, "eq-ipc", "auto", device="cuda"), _results(3, "eq-gloo-ref", "gloo")
    assert [(r["kind"], r["attached"]) for r in ipc] == [("cuda_ipc", 3)] * 3
    for a, b in zip(ipc, gloo, strict=True):
        assert {k: v for k, v in a.items() if k not in ("kind", "attached", "pid")} == {
            k: v for k, v in b.items() if k not in ("kind", "attached", "pid")
        }
    assert ipc[1]["a2a_counts"] == [1, 2, 0] and all(r["a2a_back"] for r in ipc)


def test_a_world_across_hosts_stays_on_gloo() -> None:
    """Two node addresses (two "hosts" to the placement) make a mixed world: gloo, same results."""
    mixed = _results(2, "mixed", "auto", ["127.0.0.1", "127.0.0.2"])
    one = _results(2, "one", "auto", ["127.0.0.1", "127.0.0.1"])
    assert [r["kind"] for r in mixed] == ["gloo", "gloo"]
    assert [r["kind"] for r in one] == ["shm", "shm"]
    assert [r["gather"] for r in mixed] == [r["gather"] for r in one]


def _waiter(rank: int, size: int, port: int, prefix: str, limit_s: float, q: Any) -> None:
    """Rank 0 joins a collective its peer never joins and reports how the wait ended and what it cost."""
    g = StatelessGroup(Rendezvous("127.0.0.1", port, prefix), rank, size, transport="auto", shm_bytes=4096)
    g.barrier()
    if rank != 0:
        # Puts nothing on the queue: a process SIGKILLed while its queue feeder still held the
        # queue's lock would leave rank 0's report stuck behind that lock.
        time.sleep(600)  # the test kills or stops this rank
        return
    q.put({"rank": rank, "ready": True})
    g.limit_waits(limit_s)
    time.sleep(0.5)  # the test acts on the peer now
    w0, c0 = time.monotonic(), time.process_time()
    try:
        g.all_gather([torch.empty(4) for _ in range(size)], torch.ones(4))
        code = "none"
    except GroupError as ex:
        code = ex.code.value
    q.put({"rank": 0, "code": code, "wall_s": time.monotonic() - w0, "cpu_s": time.process_time() - c0})
    g.destroy()


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_a_dead_or_hung_peer_ends_the_wait_without_spinning(fault: str) -> None:
    """SIGKILL: the survivor sees the peer's process gone (peer_gone) long before its timeout.
    SIGSTOP: it waits the step timeout and fails with timeout. Either way it sleeps, not spins:
    its CPU time over the wait is a small part of the wall time."""
    procs, q, _store = _spawn(_waiter, 2, lambda r: (f"wait-{fault}", 3.0))
    assert q.get(timeout=120)["ready"]  # rank 0 is past the barrier, so rank 1 joined the group
    peer = procs[1].pid
    os.kill(peer, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
    try:
        res = q.get(timeout=60)
    finally:
        if fault == "sigstop":
            os.kill(peer, signal.SIGKILL)
        for p in procs:
            p.join(10)
    if fault == "sigkill":
        assert res["code"] == GroupFailure.PEER_GONE.value, res
        assert res["wall_s"] < 3.0, res  # before the 3 s step timeout
    else:
        assert res["code"] == GroupFailure.TIMEOUT.value, res
        # It ends at the step timeout, as a gloo collective would (the slack: a sleep of at most
        # 1 ms, a probe, and a busy box's scheduling), never later and never stuck on the flag.
        assert 3.0 <= res["wall_s"] < 3.0 + 1.5, res
    assert res["cpu_s"] < 0.5 * res["wall_s"], f"the survivor spun while it waited: {res}"


def _aborter(rank: int, size: int, port: int, prefix: str, q: Any) -> None:
    """Rank 0 waits in a collective its peer never joins; another of its threads aborts the group."""
    import threading

    g = StatelessGroup(Rendezvous("127.0.0.1", port, prefix), rank, size, transport="auto", shm_bytes=4096)
    g.barrier()
    if rank == 1:
        # The peer joins late: the all-gather rank 0 published before it aborted may complete, the
        # next collective sees rank 0 left (its abort marks it): peer_gone, not a timeout.
        time.sleep(1.0)
        t0 = time.monotonic()
        code = "none"
        try:
            g.all_gather([torch.empty(4) for _ in range(size)], torch.ones(4))
            g.all_reduce_sum(torch.ones(2))
        except GroupError as ex:
            code = ex.code.value
        q.put({"rank": 1, "code": code, "wall_s": time.monotonic() - t0})
        return
    threading.Timer(0.5, g.abort).start()
    t0 = time.monotonic()
    try:
        g.all_gather([torch.empty(4) for _ in range(size)], torch.ones(4))
        code = "none"
    except GroupError as ex:
        code = ex.code.value
    q.put({"rank": 0, "code": code, "wall_s": time.monotonic() - t0})


def test_abort_wakes_the_waiter_and_tells_the_peer() -> None:
    procs, q, _store = _spawn(_aborter, 2, lambda r: ("abort",))
    got = {d["rank"]: d for d in (q.get(timeout=120) for _ in range(2))}
    for p in procs:
        p.join(10)
    assert got[0]["code"] == GroupFailure.ABORTED.value and got[0]["wall_s"] < 5.0, got
    assert got[1]["code"] == GroupFailure.PEER_GONE.value and got[1]["wall_s"] < 5.0, got


def _part_then_leave(rank: int, size: int, port: int, prefix: str, q: Any) -> None:
    """Rank 0 writes its part of an all-reduce and leaves the group (a committing rank leaves the
    old group once it has read the agreeing header); rank 1 is already waiting; rank 2, starved,
    arrives 0.6 s later. Each reports what its all-reduce and the next collective gave."""
    import threading

    g = StatelessGroup(Rendezvous("127.0.0.1", port, prefix), rank, size, transport="auto", shm_bytes=4096)
    g.barrier()
    if rank == 0:
        threading.Timer(0.2, g.abort).start()  # after its part is written, while rank 2 is missing
    elif rank == 2:
        time.sleep(0.6)
    out: dict[str, Any] = {"rank": rank}
    try:
        out["max"] = g.all_reduce_max(torch.tensor([rank, 10 * (rank + 1)], dtype=torch.int64)).tolist()
        g.all_reduce_sum(torch.ones(2))
        out["next"] = "none"
    except GroupError as ex:
        out["next" if "max" in out else "max"] = f"{ex.code.value}: {ex}"
    q.put(out)
    g.destroy()


def test_a_peer_that_left_after_writing_its_part_fails_only_the_next_collective() -> None:
    """The race of a scale's commit under CPU starvation:
    the ranks agree to commit through one all-reduce of their headers; the first to read it
    switches groups and leaves the old one while a slower rank still waits there for a third. That
    rank must finish the agreeing all-reduce (rank 0's part is written), not fail it for a peer
    that left (which degraded it, aborted the new group and failed the commit), and the next
    collective on the old group fails with peer_gone, naming the leaver."""
    procs, q, _store = _spawn(_part_then_leave, 3, lambda r: ("part-then-leave",))
    got = {d["rank"]: d for d in (q.get(timeout=120) for _ in range(3))}
    for p in procs:
        p.join(10)
    assert got[0]["max"].startswith("aborted"), got
    for r in (1, 2):
        assert got[r]["max"] == [2, 30], got  # every rank's part, rank 0's included
        assert got[r]["next"].startswith("peer_gone") and "[0] left the group" in got[r]["next"], got


def _oversized(rank: int, size: int, port: int, q: Any) -> None:
    g = StatelessGroup(Rendezvous("127.0.0.1", port, "big"), rank, size, transport="auto", shm_bytes=4096)
    try:
        g.all_reduce_sum(torch.ones(64 * 1024 + 1))  # past the 4 KiB the group was given
        q.put("no error")
    except GroupError as ex:  # a group's failure, which a rank's recovery path reads (is_peer_failure)
        q.put(f"{ex.code.value} {ex}")
    g.all_reduce_sum(torch.ones(4))  # every member refused the same collective: the group goes on
    # An all-to-all's parts differ per rank: only rank 0's is too large, and every member refuses it.
    n = 64 * 1024 if rank == 0 else 0
    try:
        g.all_to_all_v(torch.ones(n, 1), [0, n], lambda k: torch.empty(k, 1))
        q.put("a2a no error")
    except GroupError as ex:
        q.put(f"a2a {ex.code.value} {ex}")
    got = g.all_to_all_v(torch.full((1, 1), float(rank)), [0, 1] if rank == 0 else [1, 0], lambda k: torch.empty(k, 1))
    assert got == ([0, 1] if rank == 0 else [1, 0]), got  # and the group goes on
    g.destroy()


def test_a_collective_larger_than_the_buffer_is_refused_with_its_sizes() -> None:
    procs, q, _store = _spawn(_oversized, 2, lambda r: ())
    msgs = [q.get(timeout=120) for _ in range(4)]
    for p in procs:
        p.join(10)
    a2a = [m for m in msgs if m.startswith("a2a ")]
    assert all(
        m.startswith("overflow ") and "does not fit the group's buffer" in m and "262148 bytes" in m
        for m in msgs
        if m not in a2a
    ), msgs
    assert len(a2a) == 2 and all(m.startswith("a2a overflow ") and "rank 0's 262208 bytes" in m for m in a2a), msgs
    assert [p.exitcode for p in procs] == [0, 0]  # the collectives after the refusals completed


def test_transport_config_is_checked() -> None:
    assert EngineConfig().transport == "auto"  # the default: shared memory where a world shares a host
    EngineConfig(transport="gloo").validate()
    with pytest.raises(ValueError, match="transport must be gloo or auto"):
        EngineConfig(transport="tcp").validate()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_every_world_maps_a_new_segment_and_status_shows_it() -> None:
    """A deployment on one host serves on shm; a scale-up prepares the new world's segment in
    prepare (its event says so: I2) and the ranks report it; outputs stay the oracle's; the
    "gloo" switch keeps gloo."""
    import asyncio

    from engine_ext.launcher import LocalDeployment
    from engine_ext.model.dense_oracle import reference_generate
    from tests.engine_helpers import oracle_mismatch, run

    prompts = [[7], [1, 2, 3], [(11 * j + 3) % 256 for j in range(9)], [(97 * j + 41) % 256 for j in range(20)]]
    cfg = EngineConfig(dtype="float64", transport="auto")
    ref = reference_generate(cfg, prompts, 5)

    async def serve(dep: LocalDeployment) -> str:
        got = await asyncio.gather(*(dep.generate(p, 5) for p in prompts))
        return oracle_mismatch(list(enumerate(got)), ref)

    async def scenario() -> None:
        async with LocalDeployment(EngineConfig(dtype="float64", transport="auto"), "xport", max_dp=3) as dep:
            await dep.start(2)
            assert await serve(dep) == ""
            views = dep.registry.rank_views()
            assert {(v["transport"], v["transport_attached"], v["dp_size"]) for v in views} == {("shm", 2, 2)}
            op = await dep.scale(3, timeout_s=120)
            assert op["state"] == "succeeded", op
            prep = [e for e in dep.registry.events_for(op["op_id"]) if e["phase"] == "prepare" and e["rank"] >= 0]
            assert prep and all(
                e["detail"].get("transport") == "shm" and e["detail"].get("transport_attached") == 3 for e in prep
            ), prep
            assert await serve(dep) == ""
            await asyncio.sleep(1.5)  # a heartbeat after the switch
            views = dep.registry.rank_views()
            assert {(v["transport"], v["transport_attached"], v["dp_size"]) for v in views} == {("shm", 3, 3)}
            assert not [v for v in dep.registry.violations() if v["invariant"] == "I2"]
            # Idle on shared memory costs what idle on gloo does: the ranks sleep on the store.
            pids = [v["pid"] for v in views]
            cpu0 = sum(_cpu_s(p) for p in pids)
            await asyncio.sleep(3.0)
            idle_cpu = sum(_cpu_s(p) for p in pids) - cpu0
            assert idle_cpu < 0.3 * 3.0, f"3 idle ranks used {idle_cpu:.2f} s of CPU in 3 s"
        async with LocalDeployment(EngineConfig(dtype="float64", transport="gloo"), "xport-gloo", max_dp=2) as dep:
            await dep.start(2)
            assert await serve(dep) == ""
            assert {v["transport"] for v in dep.registry.rank_views()} == {"gloo"}

    run(scenario(), 300)


# ---- a transport mis-sized at a transition (faults: transport_sized_for_old_world) ----------------
SCALE_PROMPTS = [[7, 3], [1, 2, 3], [200, 13, 99, 5, 5], [(97 * j + 41) % 256 for j in range(20)]]


async def _scale_2_to_3(cfg: EngineConfig, name: str) -> tuple[dict, list[dict], list[dict], list[dict]]:
    """DP 2 on shared memory scales to 3, then serves: (the scale, the results, the I2 violations,
    the recoveries that ran)."""
    import asyncio

    from engine_ext.launcher import LocalDeployment

    # shrink: the recovery after a failed commit rebuilds the old members' world and stops there
    # (replace would grow back to 3 with the same fault, and fail again)
    async with LocalDeployment(cfg, name, max_dp=3, on_rank_failure="shrink") as dep:
        await dep.start(2)
        op = await dep.scale(3, timeout_s=120)
        await dep.orch.recovery.wait()
        results = await asyncio.gather(*(dep.generate(p, 8) for p in SCALE_PROMPTS * 2))
        i2 = [v for v in dep.registry.violations() if v["invariant"] == "I2"]
        return op, list(results), i2, [o for o in dep.orch.history if o.get("kind") == "recover"]


def _sizing_premise(cfg: EngineConfig) -> None:
    """The 3-rank world's exchanges are larger than the 2-rank world's: the old size is too small."""
    from engine_ext.elastic.eplb import build_layout
    from engine_ext.model.model import MoEModel

    model = MoEModel(cfg, build_layout(cfg.num_experts, cfg.slots_per_rank, 1), 0, torch.device("cpu"), cfg.seed)
    assert model.exchange_bound(3) > shm_transport._align(model.exchange_bound(2))


@pytest.mark.timeout(200)
@pytest.mark.harm("transport_sized_for_old_world")
def test_a_transport_sized_for_the_old_world_is_refused_in_prepare() -> None:
    """The check: prepare reads the new world's transport evidence (every member attached, the
    segment as large as the world's largest exchange) before any weight moves; a segment sized
    for the old world is refused, the scale rolls back, and DP 2 serves the oracle's tokens."""
    from engine_ext.model.dense_oracle import reference_generate
    from tests.engine_helpers import oracle_mismatch, run

    cfg = EngineConfig(dtype="float64", faults=["transport_sized_for_old_world"])
    _sizing_premise(cfg)
    op, results, _i2, recovers = run(_scale_2_to_3(cfg, "xport-small"), 180)
    assert op["state"] == "rolled_back", op
    assert "TransportNotPrepared" in op["error"] and "the world's exchanges need" in op["error"], op["error"]
    assert recovers == [] and {r["rank"] for r in results} <= {0, 1}
    ref = reference_generate(EngineConfig(dtype="float64"), SCALE_PROMPTS, 8)
    assert oracle_mismatch([(i % len(SCALE_PROMPTS), r) for i, r in enumerate(results)], ref) == ""


def _worst_case_combine(rank: int, size: int, port: int, shm_bytes: int, rows: int, row: int, q: Any) -> None:
    """The combine of the routing's worst case in a ``size`` world: rank 0 received every pair of
    the world and sends each back (``rows`` of ``row`` bytes); the others send nothing."""
    g = StatelessGroup(
        Rendezvous("127.0.0.1", port, "worst"), rank, size, transport="auto", shm_bytes=shm_bytes, timeout_s=5.0
    )
    n = rows if rank == 0 else 0
    counts = [n // size + (1 if j < n % size else 0) for j in range(size)]
    try:
        g.all_to_all_v(torch.zeros(n, row, dtype=torch.uint8), counts, lambda k: torch.empty(k, row, dtype=torch.uint8))
        q.put(f"{rank} no error")
    except GroupError as ex:
        q.put(f"{rank} {ex.code.value} {ex}")


@pytest.mark.timeout(200)
@pytest.mark.harm("transport_sized_for_old_world", "no_transport_check")
def test_without_the_transport_check_the_world_runs_on_a_segment_its_worst_exchange_overflows() -> None:
    """Harm: unchecked, the segment sized for the old world reaches the new world. With routed
    dispatch a step puts only the pairs its routing chose into it, so a light load still serves
    the oracle's tokens (the scale succeeds) while the world runs on a segment smaller than its
    largest legal exchange: the registry flags I2 on every rank from the prepare events'
    evidence. That exchange, run for real on a 3-rank shared-memory group with the segment the
    fault gives (every pair of the world routed to rank 0, which sends them back), fails the step
    on every member at once: rank 0's part does not fit, its header says so, and all three raise
    GroupFailure.OVERFLOW (none waits out a timeout), a group failure the ranks' recovery path
    answers by rebuilding the world. With the check on, prepare refuses the segment (the test above)."""
    from engine_ext.elastic.eplb import build_layout
    from engine_ext.model.dense_oracle import reference_generate
    from engine_ext.model.model import MoEModel
    from engine_ext.model.routed import row_bytes, worst_case
    from tests.engine_helpers import oracle_mismatch, run

    cfg = EngineConfig(dtype="float64", faults=["transport_sized_for_old_world", "no_transport_check"])
    op, results, i2, recovers = run(_scale_2_to_3(cfg, "xport-overflow"), 180)
    assert op["state"] == "succeeded" and recovers == [], (op, recovers)
    assert {v["rank"] for v in i2} == {"0", "1", "2"} and all("bytes per rank" in v["message"] for v in i2), i2
    ref = reference_generate(EngineConfig(dtype="float64"), SCALE_PROMPTS, 8)
    assert oracle_mismatch([(i % len(SCALE_PROMPTS), r) for i, r in enumerate(results)], ref) == ""
    model = MoEModel(cfg, build_layout(cfg.num_experts, cfg.slots_per_rank, 1), 0, torch.device("cpu"), cfg.seed)
    tokens = max([cfg.max_num_tokens, *cfg.capture_sizes])
    rows, row = worst_case(cfg, 3, tokens)[1], row_bytes(cfg, model.dtype)
    procs, q, _store = _spawn(_worst_case_combine, 3, lambda r: (model.exchange_bound(2), rows, row))
    msgs = sorted(q.get(timeout=120) for _ in range(3))
    for p in procs:
        p.join(30)
    assert [m.split()[:2] for m in msgs] == [["0", "overflow"], ["1", "overflow"], ["2", "overflow"]], msgs
    assert all("of rank 0's " in m and "does not fit the group's buffer" in m for m in msgs), msgs


# ---- nothing of a group outlives a failed set-up ----------------------------------------------------
def _held_in_setup(rank: int, size: int, port: int, prefix: str, held: Any, q: Any) -> None:
    """Rank 0 is held in shm set-up (the ``hold:shm_setup`` fault) once it has mapped the segment
    it made; the test SIGKILLs it there. Rank 1 reports how its set-up ended."""
    from engine_ext.faults import Faults

    faults = Faults(["hold:shm_setup@0"], 60.0, rank, on_hold=lambda phase: held.set())
    try:
        StatelessGroup(
            Rendezvous("127.0.0.1", port, prefix),
            rank,
            size,
            transport="auto",
            shm_bytes=4096,
            timeout_s=30.0,
            on_setup=lambda: faults.hold("shm_setup"),
        )
        q.put({"rank": rank, "code": "none"})
    except GroupError as ex:
        q.put({"rank": rank, "code": ex.code.value, "error": str(ex)})


def test_a_peer_killed_in_group_setup_leaves_nothing_in_dev_shm() -> None:
    """Rank 0 made the group's segment and is held in set-up; rank 1 has mapped it and waits for
    every rank to attach. SIGKILL rank 0 (by pid): rank 1 sees its process gone (peer_gone, not a
    30 s timeout) and removes the segment's name, which rank 0 would have removed once all attached."""
    held = CTX.Event()
    procs, q, _store = _spawn(_held_in_setup, 2, lambda r: ("held-setup", held))
    try:
        assert held.wait(120), "rank 0 never reached the hold in set-up"
        maker = procs[0].pid
        assert [n for n in _segments() if n.startswith(f"eepctl-{maker}-")], "no segment while rank 0 is held"
        os.kill(maker, signal.SIGKILL)  # this test's own rank process
        res = q.get(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    assert res["rank"] == 1 and res["code"] == GroupFailure.PEER_GONE.value, res
    assert [n for n in _segments() if n.startswith(f"eepctl-{maker}-")] == []


def _sockets() -> dict[str, int]:
    """This process's TCP sockets: inode -> remote port (0: listening)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    out = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    out[cols[9]] = int(cols[2].rsplit(":", 1)[1], 16)
    return out


def _mis_sized(rank: int, size: int, port: int, q: Any) -> None:
    """Rank 1 sizes the segment unlike rank 0: its set-up fails with a ValueError (not a ShmError)
    after its gloo group connected. It keeps the error (as an operation records its failure) and
    reports the sockets it still holds besides the store's."""
    from engine_ext.elastic.stores import store_client

    store_client("127.0.0.1", port, purpose="wait")  # the process-wide wake-up connections, made up front
    store_client("127.0.0.1", port, purpose="wake")
    before = set(_sockets())
    try:
        StatelessGroup(
            Rendezvous("127.0.0.1", port, "mis-sized"),
            rank,
            size,
            transport="auto",
            shm_bytes=4096 * (rank + 1),
            timeout_s=3.0,
        )
        q.put({"rank": rank, "error": "none"})
    except (GroupError, ValueError) as ex:
        kept = ex  # noqa: F841 - held, as a failed operation holds it: its frames reference the group
        left = {i: p for i, p in _sockets().items() if i not in before and p != port}
        q.put({"rank": rank, "error": f"{type(ex).__name__}: {ex}", "left": left, "pid": os.getpid()})


def test_a_setup_failing_with_any_error_destroys_the_group() -> None:
    """A set-up that fails on an error other than ShmError (a mis-sized segment: ValueError) still
    destroys the group: the failed rank holds no gloo connection afterwards, and the other rank,
    timed out waiting for it, removes the segment it made."""
    procs, q, _store = _spawn(_mis_sized, 2, lambda r: ())
    got = {d["rank"]: d for d in (q.get(timeout=120) for _ in range(2))}
    for p in procs:
        p.join(10)
    assert got[1]["error"].startswith("ValueError: shared-memory segment") and got[1]["left"] == {}, got[1]
    assert got[0]["error"].startswith("GroupError: timeout"), got[0]
    assert [n for n in _segments() if n.startswith(f"eepctl-{got[0]['pid']}-")] == []


def test_shared_allocations_are_released_with_their_tensors() -> None:
    """Expert memory a peer may map (``p2p.shared_empty``) is a memory file this process holds
    open while a tensor over it lives, and closes once the last one is freed."""
    import gc

    from engine_ext.transport.p2p import shared_empty

    def memfds() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:eepctl-experts")
            except OSError:
                pass
        return n

    gc.collect()  # earlier tests' allocations in this worker are closed now, not in the middle of the count
    before = memfds()
    w = shared_empty((4, 1024), torch.float32)
    view = w[1:3].view(-1)  # a view keeps the allocation
    del w
    gc.collect()
    assert memfds() > before  # (the mapping holds a descriptor of its own)
    del view
    gc.collect()
    assert memfds() == before
