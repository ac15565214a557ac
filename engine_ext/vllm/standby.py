"""Engine cores prepared ahead (opt-in, ``EEPCTL_VLLM_STANDBY=N``, N >= 0; `eepctl standby --count`
changes N on the running server through the registry): vLLM's own prepare, held open.

vLLM 0.32 splits a scale in its engine client. ``prepare_elastic_ep(size)`` starts the new engine
cores (``CoreEngineActorManager.scale_up_elastic_ep``: placement group, actor, imports, workers,
model, non-expert weights received, KV cache) and prepares the existing ones (new DP group, standby
groups, EPLB communicator, weights sent) while they keep serving; a prepare for the size already
prepared returns at once. ``commit_elastic_ep`` switches. With N > 0 the plugin in the API server
keeps a prepare for DP + N open while the deployment serves, so a scale to that size costs the
commit alone; the prepared cores are vLLM's own new ranks (``<base>_dp<rank>``, their placement
groups, ZMQ identities and ports), shown as ``standby`` until the commit.

vLLM leaves a prepare only by committing it. A scale to any other size first drops the held one
(``HeldPrepare.drop``): the new cores' run refs leave vLLM's liveness watch and their placement
groups are removed (vLLM's own ``remove_run_refs_for_scale_down`` and ``scale_down_elastic_ep``),
each existing engine drops its prepared state and new DP group, its workers their standby groups
and prepared EPLB communicator (``install_engine_side``: methods added under new names, reached
through vLLM's utility call and ``elastic_ep_execute``). A held prepare is dropped and made again
after ``EEPCTL_VLLM_STANDBY_REFRESH_S`` (default 1500 s): the new cores wait for the commit in a
gloo all-reduce, which fails after gloo's timeout (1800 s unless ``--cpu-distributed-timeout-seconds``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from engine_ext.control.vllm_standby import STANDBY_ENV
from engine_ext.vllm.held_cores import HeldCores

log = logging.getLogger("vllm.engine_ext")

REFRESH_ENV = "EEPCTL_VLLM_STANDBY_REFRESH_S"
DROP_ENGINE = "eepctl_drop_prepared_elastic_ep"  # added to vLLM's DPEngineCoreProc (utility call)
DROP_WORKER = "eepctl_drop_prepared"  # added to vLLM's ElasticEPScalingExecutor (elastic_ep_execute)


def enabled(env: dict[str, str] | None = None) -> bool:
    """Is the feature on: ``EEPCTL_VLLM_STANDBY`` a whole number >= 0 ("0" included: nothing prepared
    until `eepctl standby --count N` asks)? Unset or anything else: off, vLLM untouched."""
    return (os.environ if env is None else env).get(STANDBY_ENV, "").strip().isdigit()


def requested(env: dict[str, str] | None = None) -> int:
    """How many engine cores to keep prepared at the server's start (0 where off)."""
    raw = (os.environ if env is None else env).get(STANDBY_ENV, "").strip()
    return int(raw) if raw.isdigit() else 0


def held_rank(core: Any) -> bool:
    """Is this engine core a prepared new rank waiting for its commit (shown ``standby``)?"""
    state = getattr(core, "eep_scaling_state", None)
    return state is not None and getattr(state, "worker_type", "") == "new" and not state.is_complete()


# ---- the engine-core and worker side: what a drop runs there ----------------------------------------
def _drop_engine(engine: Any) -> str:
    """An existing engine's held prepare, dropped: its workers' standby groups, its new DP group, its state."""
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    state = engine.eep_scaling_state
    if state is None:
        return "none"
    if state.worker_type != "existing" or state.commit_requested or not state.is_ready_for_switch():
        raise RuntimeError(f"elastic EP state {state.state!r} ({state.worker_type}) is not a held prepare")
    engine.model_executor.collective_rpc("elastic_ep_execute", args=(DROP_WORKER,))
    if state.new_dp_group is not None:
        stateless_destroy_torch_distributed_process_group(state.new_dp_group)
    engine.eep_scaling_state = None
    engine.process_input_queue_block = True
    return "dropped"


def _drop_worker(executor: Any) -> None:
    from vllm.distributed.elastic_ep.standby_state import pop_standby_groups

    for group in pop_standby_groups().values():
        if group is not None and hasattr(group, "destroy"):
            group.destroy()
    executor._prepared_eplb_communicator = None
    executor._staged_moe_quant_methods.clear()
    executor.reconfig_request = None


def install_engine_side(process: str) -> str:
    """Add the drop to vLLM's engine-core class (``process`` "engine") or elastic-executor class
    ("worker"), under a new name: nothing of vLLM's is replaced. "active" or why not."""
    try:
        if process == "engine":
            from vllm.v1.engine.core import DPEngineCoreProc as owner

            name, fn = DROP_ENGINE, _drop_engine
        else:
            from vllm.distributed.elastic_ep.elastic_execute import ElasticEPScalingExecutor as owner

            name, fn = DROP_WORKER, _drop_worker
    except Exception as e:  # noqa: BLE001
        return f"unavailable: {type(e).__name__}: {e}"
    if getattr(owner, name, fn) is not fn:
        return f"unavailable: {owner.__name__} already has {name}"
    setattr(owner, name, fn)
    return "active"


# ---- the API server's side ------------------------------------------------------------------------
class HeldPrepare:
    """Keeps vLLM's prepare for DP + ``count`` open in the API server's event loop."""

    def __init__(self, engine_client: Any, count: int, watch: Any = None, interval_s: float = 2.0) -> None:
        self.client = engine_client
        self.core = getattr(engine_client, "engine_core", None)
        self.count = count
        self.watch = watch  # engine_ext.vllm.api_patches.ScaleWatch: no prepare while a scale runs
        self.interval_s = interval_s
        self.refresh_s = float(os.environ.get(REFRESH_ENV) or 1500)
        self.started = time.time()  # a count eepctl asked before this server started is not applied
        self._registry: Any = None  # the deployment's registry actor, where `eepctl standby` writes the count
        self.cores = HeldCores()  # the held prepare's new cores, out of vLLM's liveness watch while held
        self.gone: list[tuple[int, float]] = []  # (rank, when) of dropped cores, to forget in the registry
        self.state: dict[str, Any] = {
            "count": count,
            "asked": None,  # the id of the `eepctl standby` request applied (engine_ext.control.vllm_standby)
            "adopted": 0,
            "died": 0,  # held prepares dropped because a prepared core had died (prepared again after)
            "target": None,
            "state": "idle",
            "since": None,
            "prepare_s": None,
            "drops": 0,
            "drop_s": None,
            "error": "",
        }

    def usable(self, read: Any = None) -> str:
        """ "active", or why not: vLLM's source lacks or changed something the held prepare uses
        (engine_ext.vllm.held_symbols; ``read``: a source reader, default the installed vLLM's), or
        this engine client does not offer it."""
        from engine_ext.vllm.held_symbols import check_source

        if (why := check_source(read)) != "active":
            return why
        lock = getattr(self.client, "_elastic_ep_lock", None)
        manager = getattr(getattr(self.core, "resources", None), "engine_manager", None)
        needs = (
            ("engine client's _elastic_ep_lock", lock is not None),
            ("prepare_elastic_ep", hasattr(self.core, "prepare_elastic_ep")),
            ("_prepared_elastic_ep", hasattr(self.core, "_prepared_elastic_ep")),
            ("remove_run_refs_for_scale_down", hasattr(manager, "remove_run_refs_for_scale_down")),
            ("engine manager's run refs", all(hasattr(manager, a) for a in ("run_refs", "actor_run_ref_dict"))),
            ("placement_group_is_local", hasattr(manager, "placement_group_is_local")),
        )
        missing = [name for name, ok in needs if not ok]
        return f"unavailable: no {', '.join(missing)}" if missing else "active"

    def prepared(self) -> int | None:
        held = getattr(self.core, "_prepared_elastic_ep", None)
        return int(held[0]) if held else None

    def report(self, link: Any) -> dict[str, Any]:
        """From the API server's reporter thread, every 2 s: apply a count `eepctl standby` wrote into
        the registry (``link``: the reporter's RegistryLink, connected), return the state to publish."""
        from engine_ext.control.vllm_standby import DESIRED_KEY

        try:
            self.apply(self._asked_count(link, DESIRED_KEY))
            self._forget_gone()
        except Exception:  # noqa: BLE001 - no registry now: the count stays
            self._registry = None
        return self.published()

    def _forget_gone(self, settle_s: float = 4.0) -> None:
        """The dropped cores' ranks out of the registry once their last reports have landed: a dropped
        core sends no final report (its process is killed), so its record would stay, shown stale."""
        now = time.time()
        for gone in list(self.gone):
            if now - gone[1] >= settle_s and self._registry is not None:
                self.gone.remove(gone)
                self._registry.forget_rank.remote(gone[0])

    def apply(self, record: Any) -> None:
        """The registry's desired-count record (engine_ext.control.vllm_standby), applied once."""
        from engine_ext.control.vllm_standby import to_apply

        asked = to_apply(record, self.state["asked"], self.started)
        if asked is not None:
            self.resize(*asked)

    def published(self) -> dict[str, Any]:
        """What the API server's info carries under ``standby``."""
        return dict(self.state, prepared=self.prepared())

    def _asked_count(self, link: Any, key: str) -> Any:
        import ray
        from engine_ext.ray.names import registry_name

        if not ray.is_initialized():
            return None
        if self._registry is None:
            settings = link.settings
            self._registry = ray.get_actor(registry_name(settings.deployment), namespace=settings.namespace)
        return ray.get(self._registry.info_value.remote(key), timeout=5)

    def resize(self, count: int, asked: str | None = None) -> None:
        """Keep ``count`` engine cores prepared from the next tick on (a held prepare for another
        size is dropped there); a failure is forgotten, so the new count is tried at once."""
        self.count = count
        if self.state["state"] == "failed":
            self.state.update(state="idle", error="")
        self.state.update(count=count, asked=asked)
        log.info("engine_ext: %d engine core(s) to keep prepared (eepctl standby)", count)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception as e:  # noqa: BLE001 - serving never depends on it
                self.state.update(state="failed", error=f"{type(e).__name__}: {e}"[:300], since=time.time())
                log.warning("engine_ext: prepared engine cores: %s", self.state["error"])
                asked, until = self.state["asked"], time.time() + 30
                while time.time() < until and self.state["asked"] == asked:  # a new count is tried at once
                    await asyncio.sleep(1)

    async def tick(self) -> None:
        from engine_ext.vllm.api_patches import scaling_flag

        if self.watch is not None and self.watch.in_flight or scaling_flag():
            return
        held = self.prepared()
        if held is not None and self.cores.dead():
            async with self.client._elastic_ep_lock:
                if self.prepared() is not None and self.cores.dead():
                    await self.drop_dead()  # never adopted dead; the next tick prepares again
            return
        if held is not None and self.state["since"] and time.time() - self.state["since"] > self.refresh_s:
            async with self.client._elastic_ep_lock:
                await self.drop()  # before the new cores' gloo wait times out; the next tick prepares again
            return
        if held is None and self.state["state"] in ("prepared", "committing"):
            self.state.update(state="idle", target=None)  # committed by a scale
        pc = self.client.vllm_config.parallel_config
        target = int(pc.data_parallel_size) + self.count
        if held is not None and (not self.count or held != target):  # the count changed
            async with self.client._elastic_ep_lock:
                if self.prepared() is not None and not scaling_flag():
                    await self.drop()
            return
        if held is not None or not self.count or target > int(pc.elastic_ep_max_dp_size or 0):
            return
        async with self.client._elastic_ep_lock:
            if self.prepared() is not None or int(pc.data_parallel_size) + self.count != target or not self.count:
                return
            self.state.update(state="preparing", target=target, since=time.time(), error="")
            t0 = time.perf_counter()
            await self.core.prepare_elastic_ep(target)
            self.cores.detach(self.core.resources.engine_manager, self._new_cores())
            self.state.update(state="prepared", prepare_s=round(time.perf_counter() - t0, 3), since=time.time())
        log.info(
            "engine_ext: %d engine core(s) prepared for DP %d in %.1fs", self.count, target, self.state["prepare_s"]
        )

    async def before_scale(self, target: int) -> None:
        """Inside vLLM's scale (its lock held): a held prepare for another size is dropped first."""
        held = self.prepared()
        if held == target and self.cores.dead():
            await self.drop_dead()  # vLLM's scale then starts its own cores
        elif held is not None and held != target:
            await self.drop()
        elif held == target:
            self.cores.reattach(self.core.resources.engine_manager)  # vLLM's watch again, as it made them
            self.state.update(state="committing", adopted=self.state["adopted"] + 1)

    def _new_cores(self) -> int:
        manager = self.core.resources.engine_manager
        return len(manager.local_engine_actors) + len(manager.remote_engine_actors) - len(self.core.core_engines)

    async def drop_dead(self) -> None:
        """A held prepare whose core died: dropped, its death counted and said in the state's error."""
        dead = self.cores.dead()
        await self.drop()
        self.state.update(died=self.state["died"] + 1, error=f"{dead} prepared engine core(s) died; dropped")
        log.warning("engine_ext: %d prepared engine core(s) died; their prepare was dropped", dead)

    async def drop(self) -> None:
        """Leave the held prepare: new cores stopped, existing engines back to their serving state."""
        t0 = time.perf_counter()
        manager = self.core.resources.engine_manager
        existing = len(self.core.core_engines)
        total = len(manager.local_engine_actors) + len(manager.remote_engine_actors)
        if total > existing:  # out of vLLM's liveness watch first: a killed core must not stop the server
            if not self.cores.forget():
                manager.remove_run_refs_for_scale_down(total - existing)
            manager.scale_down_elastic_ep(total, existing)
            self.gone.extend((rank, time.time()) for rank in range(existing, total))
        await asyncio.gather(*(self.core._call_utility_async(DROP_ENGINE, engine=e) for e in self.core.core_engines))
        held, self.core._prepared_elastic_ep = self.prepared(), None
        self.state.update(
            state="idle",
            target=None,
            since=time.time(),
            drops=self.state["drops"] + 1,
            drop_s=round(time.perf_counter() - t0, 3),
        )
        log.info(
            "engine_ext: the prepare held for DP %s was dropped (%d engine core(s) stopped)", held, total - existing
        )
