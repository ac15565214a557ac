"""Run a deployment's ranks as local processes, with no Ray: a Python API for the tests and the
benchmark scripts (the GPU benchmarks run it on hosts without Ray); no eepctl command drives it.

The ranks run the same RankEngine and the same Orchestrator as under Ray; only the
transport differs (a pipe per rank instead of actor calls).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from engine_ext.capture_memory import size_captures
from engine_ext.config import EngineConfig
from engine_ext.control.orchestrator import Orchestrator
from engine_ext.control.rank_client import RANK_METHODS, RankClient
from engine_ext.control.reconciler import Reconciler
from engine_ext.control.registry_state import RegistryState
from engine_ext.control.standby_pool import StandbyPool
from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.identity import STANDBY_RANK_BASE, strip_dp_suffix
from engine_ext.errors import RankRefused

# What a rank process imports, loaded once in the fork server (``rank_context``).
RANK_PRELOAD = ["torch", "engine_ext.rank.engine"]


def rank_context() -> mp.context.BaseContext:
    """Where rank processes come from: a fork server that imported torch and the engine once, so a
    rank starts in ~10 ms instead of the 1-2 s (2-4 s on a busy box) a fresh interpreter spends on
    those imports, and ranks share those pages. The server imports nothing that initialises CUDA
    (checked: ``torch.cuda.is_initialized()`` stays False), so each rank sets up its own device.
    ``EEP_RANK_START=spawn`` starts every rank as a fresh interpreter instead."""
    method = os.environ.get("EEP_RANK_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"EEP_RANK_START must be forkserver or spawn, got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(RANK_PRELOAD)  # takes effect when the server starts (once per process)
    return ctx


def _rank_main(
    conn: Connection,
    cfg_d: dict[str, Any],
    name: str,
    rank: int,
    layout_d: dict[str, Any],
    joining: bool,
    device: str,
    env: dict[str, str],
    standby: int = -1,
) -> None:
    # The launcher's environment at this launch, as a spawned child would inherit it: a forked
    # one would otherwise see the fork server's, from when the server started.
    os.environ.clear()
    os.environ.update(env)
    from engine_ext.rank.engine import RankEngine

    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    engine = RankEngine(
        EngineConfig.from_dict(cfg_d),
        name,
        rank,
        ExpertLayout.from_dict(layout_d),
        joining=joining,
        device=device,
        sink=lambda kind, payload: send((kind, payload)),
    )
    if standby >= 0:  # launched ahead for the standby pool
        from engine_ext.rank.standby import enter_standby

        enter_standby(engine, standby)
    engine.start_heartbeat()

    def handle(call_id: int, method: str, args: tuple) -> None:
        try:
            if method not in RANK_METHODS:
                raise AttributeError(f"rank has no method {method!r}")
            value = getattr(engine, method)(*args)
            send(("reply", call_id, True, value))
        except BaseException as e:  # noqa: BLE001 - the controller gets every failure as a reply
            refusal = e if isinstance(e, RankRefused) else None  # its code crosses the pipe (the router reads it)
            send(("reply", call_id, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", refusal))

    while True:
        try:
            call_id, method, args = conn.recv()
        except (EOFError, OSError):
            break
        threading.Thread(target=handle, args=(call_id, method, args), daemon=True).start()
    engine.stop()


class RankCallError(RuntimeError):
    pass


class ProcessRankClient(RankClient):
    """A rank in a child process, called over a pipe; replies and reports share it."""

    def __init__(self, rank: int, proc: mp.process.BaseProcess, conn: Connection, owner: LocalDeployment) -> None:
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"rank{rank}-reader")
        self._reader.start()

    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def renumber(self, rank: int) -> None:
        """The process became DP rank ``rank`` (an adopted standby)."""
        self.rank = rank

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            if not self._post(self._dispatch, msg):
                return
        self._post(self._fail_pending)
        # The pipe closed: the process is gone (or going). That is the launcher's death signal.
        time.sleep(self.owner.death_report_delay_s)
        self._post(self.owner.on_rank_exit, self.rank, self.proc)

    def _post(self, fn: Any, *args: Any) -> bool:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the event loop already closed: nobody is waiting any more
            return False

    def _fail_pending(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(RankCallError(f"rank {self.rank} process exited"))
        self._pending.clear()

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "reply":
            _, call_id, ok, value, *refusal = msg
            fut = self._pending.pop(call_id, None)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    error = RankCallError(value)
                    error.__cause__ = refusal[0] if refusal else None
                    fut.set_exception(error)
        else:
            self.owner.on_report(kind, msg[1], self.rank)

    async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
        call_id = next(self._ids)
        fut = self.loop.create_future()
        self._pending[call_id] = fut
        with self._send_lock:
            self.conn.send((call_id, method, args))
        return await asyncio.wait_for(fut, timeout)

    async def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 10)


class ProcessSpawner:
    """The launcher's ``Spawner`` (engine_ext.control.spawner): ranks as child processes."""

    def __init__(self, owner: LocalDeployment) -> None:
        self.owner = owner
        self.ctx = rank_context()

    def check_capacity(self, new_ranks: int, ranks: list[int] | None = None) -> str | None:
        return None

    @property
    def pool(self) -> StandbyPool | None:
        return self.owner.pool

    async def spawn(self, rank: int, layout: ExpertLayout, joining: bool) -> ProcessRankClient:
        """DP rank ``rank``; a joiner is a standby from the pool when one is ready."""
        o = self.owner
        if joining and o.pool is not None and (taken := await o.pool.take(rank, layout)) is not None:
            assert isinstance(taken, ProcessRankClient)
            taken.renumber(rank)
            o.processes[rank] = taken
            return taken
        return await self.launch(rank, layout, joining)

    async def launch_standby(self, n: int) -> ProcessRankClient:
        """A standby process (engine_ext.control.standby_pool): a joining rank at a rank number no world uses."""
        assert self.owner.orch.layout is not None
        return await self.launch(STANDBY_RANK_BASE + n, self.owner.orch.layout, True, standby=n)

    async def launch(self, rank: int, layout: ExpertLayout, joining: bool, standby: int = -1) -> ProcessRankClient:
        parent, child = self.ctx.Pipe()
        o = self.owner
        device = o.device_for(rank if standby < 0 else 0)
        proc = self.ctx.Process(
            target=_rank_main,
            name=f"{o.name}_dp{rank}" if standby < 0 else f"{o.name}_standby{standby}",
            args=(
                child,
                o.cfg.to_dict(),
                o.name,
                rank,
                layout.to_dict(),
                joining,
                device,
                {**os.environ, **o.env},
                standby,
            ),
            daemon=True,
        )
        proc.start()
        child.close()
        client = ProcessRankClient(rank, proc, parent, o)
        if standby < 0:
            o.processes[rank] = client
        try:
            await client.status(timeout=300)  # launched = the engine is built and answering
        except BaseException:
            # A launch that fails or is cancelled leaves no process behind: a stop while the pool
            # refilled left the standby being launched running, unowned (on a GPU, each held its
            # memory until the launcher exited: 9 GiB apiece in a curves run, which ran out).
            if proc.is_alive():
                proc.kill()
            raise
        return client


async def _process_alive(client: RankClient) -> bool:
    return isinstance(client, ProcessRankClient) and client.proc.is_alive()


class LocalDeployment:
    """A deployment whose ranks are child processes of this one. Use ``async with``."""

    def __init__(
        self,
        cfg: EngineConfig,
        name: str = "local",
        *,
        max_dp: int = 8,
        device: str = "cpu",
        env: dict[str, str] | None = None,
        on_rank_failure: str = "replace",
        standby: int = 0,
        health_deadline_s: float = 5.0,
        death_report_delay_s: float = 0.0,
    ) -> None:
        size_captures(cfg, max_dp)  # resolves capture policy auto before any rank starts
        # Seconds from a rank's pipe closing to its death report. The pipe tells at once; Ray
        # tells seconds late, so calls can fail on a death nobody reported yet (tests set it).
        self.death_report_delay_s = death_report_delay_s
        self.cfg = cfg
        self.name = name
        self.device = device
        self.env = env or {}
        self.processes: dict[int, ProcessRankClient] = {}
        self.registry = RegistryState(name)
        self.registry.set_info({"max_dp": max_dp, "config": cfg.to_dict()})  # as the Ray controller records it
        spawner = ProcessSpawner(self)
        self.orch = Orchestrator(
            name,
            cfg,
            spawner,
            max_dp=max_dp,
            emit=self.registry.report_event,
            record_op=self.registry.record_operation,
            forget_rank=self.registry.forget_rank,
            on_rank_failure=on_rank_failure,
        )
        self.orch.admission.device = device  # the cost model's host check (engine_ext.control.cost_model)
        # The same reconcile loop as the Ray controller: fences a silent or failed rank (SIGKILL),
        # rebuilds from the weight source when no healthy rank is left, grows back.
        self.reconciler = Reconciler(self.orch, deadline_s=health_deadline_s)
        self.pool: StandbyPool | None = self._make_pool(spawner, standby) if standby > 0 else None
        self._pool_watch: asyncio.Task[None] | None = None

    def _make_pool(self, spawner: ProcessSpawner, size: int) -> StandbyPool:
        pool = StandbyPool(
            size,
            spawner.launch_standby,
            _process_alive,
            lambda c: c.kill(),
            self.registry.forget_rank,  # type: ignore[attr-defined]
            lambda: self.orch.running_op() is not None,
        )
        pool.identity_base = strip_dp_suffix(self.cfg.instance_id or self.name)
        return pool

    def device_for(self, rank: int) -> str:
        if self.device == "cuda-per-rank":
            return f"cuda:{rank}"
        return self.device

    def on_report(self, kind: str, payload: dict[str, Any], rank: int) -> None:
        if kind == "status":
            self.registry.report_status(payload)
        elif kind == "event":
            self.registry.report_event(payload)
        elif kind == "results":
            self.orch.router.on_results(payload["results"], rank)
        elif kind == "tokens":
            self.orch.router.on_tokens(payload["tokens"], rank)

    def on_rank_exit(self, rank: int, proc: mp.process.BaseProcess) -> None:
        current = self.processes.get(rank)
        if current is not None and current.proc is not proc:
            return  # a late report of a process already replaced under this rank number: not news
        proc.join(0.5)
        code = proc.exitcode
        cause = (
            f"process exited (exit code {code})"
            if code is not None and code >= 0
            else f"process killed by signal {-code}"
            if code is not None
            else "rank pipe closed"
        )
        self.orch.recovery.on_death(rank, cause)

    async def start(self, size: int) -> None:
        await self.orch.start(size)
        self.reconciler.start()
        if self.pool is not None:
            await self.pool.fill()
            self._pool_watch = asyncio.get_running_loop().create_task(self.pool.watch())

    async def set_standby(self, count: int) -> dict[str, Any]:
        """Keep ``count`` ranks launched ahead (0 stops them), as the Ray controller's ``set_standby``."""
        if self.pool is None:
            self.pool = self._make_pool(self.orch.spawner, count)  # type: ignore[arg-type]
        await self.pool.resize(count)
        if self._pool_watch is None:
            self._pool_watch = asyncio.get_running_loop().create_task(self.pool.watch())
        return self.pool.summary()

    async def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return await self.orch.router.submit(prompt, max_tokens)

    async def scale(self, size: int, **kw: Any) -> dict[str, Any]:
        return await self.orch.scale(size, **kw)

    async def stop(self) -> None:
        self.reconciler.stop()
        if self.pool is not None:
            if self._pool_watch is not None:
                self._pool_watch.cancel()
            await self.pool.stop()
        await self.orch.stop()
        for c in list(self.processes.values()):
            await c.kill()

    async def __aenter__(self) -> LocalDeployment:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
