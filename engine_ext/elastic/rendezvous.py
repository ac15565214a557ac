"""Where a group meets. Torch-free, so the controller plans without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rendezvous:
    """The store host/port and a prefix unique to one operation (a fresh rendezvous per op)."""

    host: str
    port: int
    prefix: str
    # The world this rendezvous forms: one per rendezvous, increasing. Ranks carry it in every
    # report and token stream, so a rank fenced out of an older world is recognised and ignored.
    epoch: int = 0

    def child(self, name: str) -> Rendezvous:
        return Rendezvous(self.host, self.port, f"{self.prefix}/{name}", self.epoch)
