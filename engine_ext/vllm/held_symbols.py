"""What the held prepare (engine_ext.vllm.standby, engine_ext.vllm.held_cores) reads and calls of
vLLM, and the check that refuses it when one of them is missing from vLLM's source.

The held prepare adds no wrapper: it calls vLLM's engine client, engine-actor manager, engine core
and elastic executor, and reads and edits their instance attributes (the manager's run refs, the
client's prepared size, the executor's prepared EPLB communicator...). An instance attribute is
checked as assigned in its class's ``__init__`` (engine_ext.vllm.signatures reads which methods
assign ``self.<name>``), a method or function by its leading parameter names and whether it is a
coroutine, a config field as declared in its class body. The records of each supported release
(engine_ext.vllm.signature_records) hold these symbols; at the API server's start the plugin reads
the installed vLLM's source the same way and applies ``EEPCTL_VLLM_STANDBY`` only where every one
holds (else ``api_patches.standby`` is ``unavailable: <why>``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

_CLIENT = "vllm.v1.engine.core_client"
_MANAGER = "vllm.v1.engine.utils:CoreEngineActorManager"
_STATE = "vllm.distributed.elastic_ep.elastic_state:ElasticEPScalingState"
_EXECUTOR = "vllm.distributed.elastic_ep.elastic_execute:ElasticEPScalingExecutor"
INIT = "__init__"


@dataclass(frozen=True)
class Need:
    """One vLLM symbol the held prepare uses. ``form``: "attribute" (assigned as ``self.<name>`` in
    the class's ``__init__``), "field" (declared in the class body), "function" or "coroutine" (a
    function whose parameters start with ``params``)."""

    symbol: str
    form: str
    params: tuple[str, ...] = ()


def _attrs(cls: str, *names: str) -> tuple[Need, ...]:
    return tuple(Need(f"{cls}.{n}", "attribute") for n in names)


NEEDS: tuple[Need, ...] = (
    # API server: the engine client, its core client and the engine-actor manager (standby.HeldPrepare)
    *_attrs("vllm.v1.engine.async_llm:AsyncLLM", "_elastic_ep_lock", "engine_core", "vllm_config"),
    Need("vllm.config.parallel:ParallelConfig.data_parallel_size", "field"),
    Need("vllm.config.parallel:ParallelConfig.elastic_ep_max_dp_size", "field"),
    Need(f"{_CLIENT}:DPLBAsyncMPClient.prepare_elastic_ep", "coroutine", ("self", "new_data_parallel_size")),
    *_attrs(f"{_CLIENT}:DPLBAsyncMPClient", "_prepared_elastic_ep"),
    *_attrs(f"{_CLIENT}:MPClient", "resources", "core_engines"),
    Need(f"{_CLIENT}:BackgroundResources.engine_manager", "field"),
    Need(f"{_CLIENT}:AsyncMPClient._call_utility_async", "coroutine", ("self", "method", "*args", "engine")),
    # the held cores out of vLLM's liveness watch and back (held_cores.HeldCores), a drop's scale-down
    *_attrs(_MANAGER, "local_engine_actors", "remote_engine_actors", "placement_group_is_local"),
    *_attrs(_MANAGER, "run_refs", "actor_run_ref_dict"),
    Need(f"{_MANAGER}.remove_run_refs_for_scale_down", "function", ("self", "removed_dp_size")),
    Need(f"{_MANAGER}.scale_down_elastic_ep", "function", ("self", "cur_data_parallel_size", "new_data_parallel_size")),
    # engine core: the drop (standby._drop_engine, a utility call) and the standby state (standby.held_rank)
    *_attrs("vllm.v1.engine.core:DPEngineCoreProc", "eep_scaling_state"),
    *_attrs("vllm.v1.engine.core:EngineCoreProc", "process_input_queue_block"),
    *_attrs("vllm.v1.engine.core:EngineCore", "model_executor"),
    Need("vllm.v1.executor.abstract:Executor.collective_rpc", "function", ("self", "method", "timeout", "args")),
    *_attrs(_STATE, "worker_type", "commit_requested", "new_dp_group", "state"),
    Need(f"{_STATE}.is_ready_for_switch", "function", ("self",)),
    Need(f"{_STATE}.is_complete", "function", ("self",)),
    Need("vllm.distributed.utils:stateless_destroy_torch_distributed_process_group", "function", ("pg",)),
    # worker: the drop (standby._drop_worker, through the worker's elastic_ep_execute)
    Need("vllm.v1.worker.gpu_worker:Worker.elastic_ep_execute", "function", ("self", "execute_method", "*args")),
    Need(f"{_EXECUTOR}.execute", "function", ("self", "execute_method", "*args")),
    *_attrs(_EXECUTOR, "_prepared_eplb_communicator", "_staged_moe_quant_methods", "reconfig_request"),
    Need("vllm.distributed.elastic_ep.standby_state:pop_standby_groups", "function", ()),
)

SYMBOLS: tuple[str, ...] = tuple(n.symbol for n in NEEDS)


def holds(need: Need, rec: dict | None) -> bool:
    """Does a symbol's record (engine_ext.vllm.signatures) still offer what the held prepare uses?"""
    if rec is None:
        return False
    if need.form == "attribute":
        return rec["kind"] == "attribute" and INIT in rec["assigned_in"]
    if need.form == "field":
        return rec["kind"] == "value"
    is_async = need.form == "coroutine"
    return (
        rec["kind"] == "function"
        and rec["async"] is is_async
        and rec["params"][: len(need.params)] == list(need.params)
    )


def check(records: dict[str, dict | None]) -> str:
    """ "active", or "unavailable: <why>" naming each symbol a release's records lack or changed."""
    bad = [n.symbol.split(":")[1] for n in NEEDS if not holds(n, records.get(n.symbol))]
    return f"unavailable: vLLM's source lacks or changed {', '.join(bad)}" if bad else "active"


def check_source(read: Callable[[str], str | None] | None = None) -> str:
    """``check`` on vLLM's source (``read``: engine_ext.vllm.signatures' reader; default the installed vLLM)."""
    from engine_ext.vllm import signatures

    try:
        if read is None:
            read, _ = signatures.installed_reader()
        return check(signatures.extract(read, SYMBOLS))
    except Exception as e:  # noqa: BLE001 - an unreadable source is refused, saying why
        return f"unavailable: vLLM's source not read: {type(e).__name__}: {e}"
