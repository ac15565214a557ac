"""benchmarks/curves.py --quick runs end to end (so the script cannot rot), and the transfer path
reports what the curves divide by: the bytes each joiner received from the weight storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_curves_quick_runs_and_reports_transfer_bytes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "curves.py"),
            "--quick",
            "--parts",
            "link,bytes",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "curves_quick.json").read_text())
    assert [r["bytes"] for r in res["link"]] == [2**20, 8 * 2**20]
    assert all(r["raw_GBps"] > 0 and r["gloo_direct_GBps"] > 0 for r in res["link"])
    (row,) = res["bytes"]
    assert row["state"] == "succeeded" and row["failed"] == 0 and row["requests"] > 0, row
    # Each joiner received its slots' experts, reported by the pre-copy itself in bytes: 4 slots
    # of one expert each (1/8 of the model's expert bytes).
    per_expert = int(row["expert_MiB"] * 2**20) // 8
    assert [j["rank"] for j in row["joiners"]] == [2, 3], row["joiners"]
    for j in row["joiners"]:
        assert j["bytes_reported"] and j["expert_bytes"] == 4 * per_expert and j["reshuffle_s"] > 0, j
    # ...and where its time went (packing and exchange in the pre-copy, loading in the commit)
    parts = row["reshuffle_parts_by_rank"]
    assert sorted(parts) == ["0", "1", "2", "3"] and all(
        set(p) >= {"pack_s", "exchange_s", "load_s"} for p in parts.values()
    ), parts
    assert sum(p["received"] for p in parts.values()) == sum(p["sent"] for p in parts.values()) > 0, parts
    assert (tmp_path / "curves_quick.svg").read_text().startswith("<svg")
