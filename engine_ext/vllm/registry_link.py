"""The link from a vLLM process to its deployment's registry actor (``eep-registry.<deployment>``).

Every reporter thread of the plugin (engine_ext.vllm.reporter, engine_ext.vllm.worker_reporter)
sends through one: calls are fire-and-forget, Ray is imported and connected only on the first call
(from the reporter's own thread), and a lost registry is recreated on the next call.
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from dataclasses import dataclass
from typing import Any

from engine_ext.records import DeploymentKind

log = logging.getLogger("vllm.engine_ext")

KIND = DeploymentKind.VLLM.value


@dataclass(frozen=True)
class Settings:
    deployment: str
    namespace: str
    address: str


class RegistryLink:
    """Fire-and-forget calls to ``eep-registry.<deployment>``; created (kind "vllm") if missing.

    A lost registry is recreated on the next call and given the recent events again (it drops
    duplicates), so it rebuilds the picture from the ranks as the reference registry does.
    """

    def __init__(self, settings: Settings, resend: int = 500) -> None:
        self.settings = settings
        self._handle: Any = None
        self._pending: Any = None
        self._recent: deque[dict[str, Any]] = deque(maxlen=resend)
        self.disabled = ""
        self.connects = 0  # registries reached: a new one (after `eepctl down` or a loss) counts again
        self._warned: set[str] = set()

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def connect(self) -> bool:
        if self.disabled:
            return False
        if self._handle is not None:
            return True
        try:
            import ray
            from engine_ext.ray.names import registry_name
            from engine_ext.ray.registry import Registry

            if not ray.is_initialized():
                ray.init(address=self.settings.address, logging_level=logging.ERROR, log_to_driver=False)
            name = registry_name(self.settings.deployment)
            handle = (
                ray.remote(Registry)
                .options(
                    name=name, namespace=self.settings.namespace, lifetime="detached", num_cpus=0, get_if_exists=True
                )
                .remote(self.settings.deployment, KIND)
            )
            kind = ray.get(handle.snapshot.remote(), timeout=30).get("kind")
            if kind != KIND:
                self.disabled = f"registry {name} belongs to a {kind!r} deployment"
                log.warning("engine_ext: %s; this vLLM process does not report to it", self.disabled)
                return False
            self._handle = handle
            self.connects += 1
            if self._recent:
                handle.report_events.remote(list(self._recent))
            log.info("engine_ext: reporting to %s in namespace %s", name, self.settings.namespace)
            return True
        except Exception as e:  # noqa: BLE001 - the registry is optional for serving
            self._warn_once(
                "connect",
                "engine_ext: registry of %s not reachable yet (%s: %s); retrying",
                self.settings.deployment,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            self._handle = None
            return False

    def _call(self, method: str, *args: Any) -> Any:
        if not self.connect():
            return None
        try:
            return getattr(self._handle, method).remote(*args)
        except Exception as e:  # noqa: BLE001
            log.debug("engine_ext: %s failed (%s); reconnecting", method, e)
            self._handle = None
            return None

    def report_status(self, status: dict[str, Any]) -> None:
        self._check_pending()
        self._pending = self._call("report_status", status)

    def report_worker(self, record: dict[str, Any]) -> None:
        self._check_pending()  # a dead registry is noticed here, as for report_status
        self._pending = self._call("report_worker", record)

    def report_events(self, events: list[dict[str, Any]]) -> None:
        if events:
            self._recent.extend(events)
            self._call("report_events", events)

    def set_info(self, info: dict[str, Any]) -> None:
        self._check_pending()  # the API server only sets info: a registry `down` removed is noticed here too
        self._pending = self._call("set_info", info)

    def _check_pending(self) -> None:
        """Look at the previous status report's answer without waiting for it."""
        ref, self._pending = self._pending, None
        if ref is None:
            return
        try:
            import ray

            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                return
            answer = ray.get(ready[0], timeout=1)
            if isinstance(answer, dict) and not answer.get("accepted", True):
                self._warn_once("dup", "engine_ext: registry refused this rank: %s", answer.get("reason"))
        except Exception as e:  # noqa: BLE001 - the actor died: recreate it on the next call
            log.debug("engine_ext: registry call failed (%s); reconnecting", e)
            self._handle = None


def node_name() -> str:
    host = socket.gethostname()
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        ip = ""
    return f"{host}/{ip}" if ip else host
