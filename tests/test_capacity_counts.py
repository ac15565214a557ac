"""benchmarks/capacity.py counts what was served: the tokens the answers carried, and a request the
router answered with an error (or a call that raised) as a failure that adds no tokens. The
deployment is a stand-in that answers as ``LocalDeployment.generate`` does (the router's result
dicts): what is tested is the benchmark's arithmetic, not a deployment."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from benchmarks import capacity


class _Answers:
    """Answers in turn: served in full, served short, an error result, a raised call."""

    def __init__(self) -> None:
        self.kinds = itertools.cycle(["full", "short", "error", "raise"])
        self.sent: list[str] = []

    async def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        await asyncio.sleep(0.002)
        kind = next(self.kinds)
        self.sent.append(kind)
        if kind == "raise":
            raise ConnectionError("rank gone")
        if kind == "error":
            return {"output": [], "error": "no rank accepted the request (rank 0: failed)", "rank": -1}
        return {"output": list(range(max_tokens if kind == "full" else 3)), "error": None, "rank": 0}


def _expected(sent: list[str], tokens: int) -> tuple[int, int, int]:
    served = [k for k in sent if k in ("full", "short")]
    return len(served), len(sent) - len(served), sum(tokens if k == "full" else 3 for k in served)


def test_closed_and_open_loads_count_tokens_received_and_failures() -> None:
    for run in ("closed", "open"):
        dep = _Answers()
        if run == "closed":
            row = asyncio.run(capacity._closed(dep, 3, 16, 0.3))
        else:
            row = asyncio.run(capacity._open(dep, 200.0, 16, 0.3))
        requests, failed, tokens = _expected(dep.sent, 16)
        assert failed > 0 and (row["requests"], row["failed"]) == (requests, failed), (run, dep.sent, row)
        assert row.get("tokens") == tokens and 0 < row["tok_s"] < row["requests"] * 16 / 0.3, (run, row)
