"""vLLM's Ray workers on the plugin's CPU platform: the one method that needs an accelerator.

vLLM's Ray executor (``RayDistributedExecutor``) starts each worker as a Ray actor holding one
unit of the platform's Ray device key and asks it for its accelerator ids
(``RayWorkerWrapper.get_node_and_physical_gpu_ids``, ``v1/executor/ray_utils.py``), which index
``ray.get_runtime_context().get_accelerator_ids()`` by that key. Ray lists there only the
accelerator resources it knows (GPU, TPU, NPU, ...); ``vllm_cpu_rank`` is a custom resource, so
the lookup fails with a ``KeyError`` before any worker starts. ``EepCpuRayWorker`` answers the
node and no device ids (a CPU worker binds none; vLLM only stores them in
``parallel_config.assigned_physical_gpu_ids``, which only the GPU worker reads). The CPU patch
``ray_cpu_worker`` (engine_ext.vllm.cpu_patches) makes the executor start this class. The class
is built on first access, so importing this module imports nothing of vLLM; Ray pickles it by
reference, and each worker process builds it the same way.
"""

from __future__ import annotations

from typing import Any

QUALNAME = "engine_ext.vllm.cpu_ray.EepCpuRayWorker"
_classes: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "EepCpuRayWorker":
        return worker_class()
    if name == "EepCpuRayWorkerProc":
        return worker_proc_class()
    raise AttributeError(name)


def worker_class() -> type:
    """For vLLM's Ray executor (``RayDistributedExecutor``, ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``)."""
    if "v1" not in _classes:
        _classes["v1"] = _build()
    return _classes["v1"]


def worker_proc_class() -> type:
    """For vLLM's default Ray executor (``RayExecutorV2``: ``RayWorkerProc`` actors)."""
    if "v2" not in _classes:
        _classes["v2"] = _build_proc()
    return _classes["v2"]


def _node_and_no_devices(self: Any) -> tuple[str, list[int]]:
    import ray

    return ray.get_runtime_context().get_node_id(), []


def _build_proc() -> type:
    from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

    cls = type(
        "EepCpuRayWorkerProc",
        (RayWorkerProc,),
        {
            "__doc__": "vLLM's Ray worker process, answering its accelerator ids on a CPU rank.",
            "__module__": __name__,
            "__qualname__": "EepCpuRayWorkerProc",
            "get_node_and_physical_gpu_ids": _node_and_no_devices,
        },
    )
    return cls


def _build() -> type:
    from vllm.v1.executor.ray_utils import RayWorkerWrapper

    class EepCpuRayWorker(RayWorkerWrapper):  # type: ignore[misc, valid-type]
        """vLLM's Ray worker wrapper, answering its accelerator ids on a CPU rank."""

        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            import ray

            return ray.get_runtime_context().get_node_id(), []

    EepCpuRayWorker.__module__ = __name__
    EepCpuRayWorker.__qualname__ = "EepCpuRayWorker"
    return EepCpuRayWorker


def ray_worker_proc_class(original: Any) -> Any:
    """The ``cpu_patches`` replacement for ``RayWorkerProc`` as ``v1/executor/ray_executor_v2.py``
    sees it (its ``ray.remote(RayWorkerProc)``)."""
    return worker_proc_class()


def ray_worker_class(original: Any) -> Any:
    """The ``cpu_patches`` replacement for ``RayWorkerWrapper`` as ``v1/executor/ray_executor.py``
    sees it (its two ``ray.remote(...)(RayWorkerWrapper)`` calls)."""
    return worker_class()
