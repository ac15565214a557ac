"""The engine cores of a held prepare, watched by the plugin instead of vLLM while they wait.

vLLM's ``CoreEngineActorManager.scale_up_elastic_ep`` adds each new core's run ref to the refs its
liveness monitor waits on (``monitor_engine_liveness``: a core whose run ends stops every engine
core and the server). A core held prepared for minutes is not serving: its death must not take the
deployment down, and it must never be adopted dead. So once a prepare is held, its new cores' run
refs leave vLLM's watch (vLLM's own ``remove_run_refs_for_scale_down``) and are kept here; the held
prepare's tick asks ``dead()`` and drops a prepare whose core died (the next tick prepares again);
before a commit adopts them they go back into vLLM's watch (``reattach``), where a scale leaves them.
"""

from __future__ import annotations

from typing import Any


class HeldCores:
    """The (actor, run ref) pairs of the prepared cores taken out of vLLM's liveness watch."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Any, Any]] = []

    def detach(self, manager: Any, count: int) -> None:
        """Take the newest ``count`` cores' run refs out of vLLM's watch, keeping them here; the
        cores are picked as vLLM's ``remove_run_refs_for_scale_down`` picks them."""
        if count <= 0 or self.pairs:
            return
        local, remote = list(manager.local_engine_actors), list(manager.remote_engine_actors)
        pairs = []
        for is_local in reversed(manager.placement_group_is_local[-count:]):
            actor = (local if is_local else remote).pop()
            pairs.append((actor, manager.actor_run_ref_dict[actor]))
        manager.remove_run_refs_for_scale_down(count)
        self.pairs = pairs

    def dead(self) -> int:
        """How many of the held cores' runs have ended (their process died or was killed)."""
        if not self.pairs:
            return 0
        import ray

        refs = [ref for _, ref in self.pairs]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(done)

    def reattach(self, manager: Any) -> None:
        """Hand the cores back to vLLM's watch (a commit adopts them)."""
        for actor, ref in reversed(self.pairs):
            manager.actor_run_ref_dict[actor] = ref
            manager.run_refs.append(ref)
        self.pairs = []

    def forget(self) -> bool:
        """The cores are being removed (a drop): True when their refs were out of vLLM's watch."""
        was, self.pairs = bool(self.pairs), []
        return was
