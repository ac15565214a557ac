"""A vLLM worker's own record and events, sent to the registry from a daemon thread of the worker.

The worker holds what only it sees (the MoE workspace, every warm-up and capture pass with its
per-size timings, the elastic steps as they run), and reports it itself under its DP rank,
whatever executor started it: ``uni`` (inside the engine-core process), ``mp`` (a child of it)
or ``ray`` (a Ray actor, the executor vLLM picks for the Ray DP backend). The registry merges the
record into the engine core's (engine_ext.control.worker_records).

The thread starts when the sink first sees the worker (its first wrapped call, after vLLM has
loaded the model and started every process it starts), connects to Ray lazily inside the thread
(a Ray worker is already connected; an ``mp`` worker joins the cluster as a driver), and wakes
about once a second and at every phase boundary. Ray calls never happen in a step, only here,
fire-and-forget. Only the driver worker of a DP rank (TP rank 0) reports.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from engine_ext.rank.status_fields import process_rss_bytes
from engine_ext.vllm.registry_link import RegistryLink, Settings, node_name

log = logging.getLogger("vllm.engine_ext")


def executor_name(vllm_config: Any) -> str:
    """What started this worker, as vLLM's config names it: "uni", "mp", "ray" or a class name."""
    backend = getattr(getattr(vllm_config, "parallel_config", None), "distributed_executor_backend", None)
    if isinstance(backend, type):
        return "ray" if getattr(backend, "uses_ray", False) else backend.__name__
    return str(backend or "")


class WorkerReporter(threading.Thread):
    """The worker's record (engine_ext.records.VllmWorkerStatus) and events, to the registry."""

    def __init__(self, settings: Settings, sink: Any, interval_s: float = 1.0) -> None:
        super().__init__(name="eepctl-vllm-worker-reporter", daemon=True)
        self.settings = settings
        self.sink = sink
        self.interval_s = interval_s
        self.link = RegistryLink(settings)
        self.wake = threading.Event()
        self.node = node_name()
        self.executor = ""

    @classmethod
    def attach(cls, settings: Settings, sink: Any) -> None:
        """Start one when the sink first sees its worker (only the driver worker of a DP rank)."""

        def first_seen(worker: Any) -> None:
            if not getattr(worker, "is_driver_worker", True):
                return
            reporter = cls(settings, sink)
            reporter.executor = executor_name(getattr(worker, "vllm_config", None))
            sink.on_change = reporter.wake.set
            reporter.start()

        sink.on_worker = first_seen

    def record(self) -> dict[str, Any] | None:
        snap = self.sink.snapshot()
        if "rank" not in snap:  # the worker is gone
            return None
        return dict(
            snap,
            deployment=self.settings.deployment,
            executor=self.executor,
            node=self.node,
            rss_bytes=process_rss_bytes(),
        )

    def run(self) -> None:
        try:
            while not self.link.disabled:
                record = self.record()
                if record is None:
                    return
                self.link.report_events(self.sink.drain_events())
                self.link.report_worker(record)
                self.wake.wait(self.interval_s)
                self.wake.clear()
        except Exception as e:  # noqa: BLE001 - never take the worker down
            log.warning("engine_ext: worker reporter stopped: %s: %s", type(e).__name__, e)
