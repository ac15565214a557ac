"""Where a group meets. Torch-free, so the controller plans without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rendezvous:
    """The store host/port and a prefix unique to one operation (a fresh rendezvous per op)."""

    host: str
    port: int
    prefix: str

    def child(self, name: str) -> Rendezvous:
        return Rendezvous(self.host, self.port, f"{self.prefix}/{name}")
