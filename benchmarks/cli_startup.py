"""Wall time of `eepctl --help` as a whole process, and proof it imports neither ray nor torch.

Usage: .venv/bin/python benchmarks/cli_startup.py [runs]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def timed(cmd: list[str], runs: int) -> list[float]:
    subprocess.run(cmd, capture_output=True, check=True)  # warm-up (page cache, pyc)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    heavy = (
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from eepctl.main import run; run(['--help']); "
                "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch', 'vllm'}))",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    print(f"heavy modules imported by --help: {heavy}")
    for label, cmd in (
        ("eepctl --help", [sys.executable, "-m", "eepctl", "--help"]),
        ("eepctl scale --help", [sys.executable, "-m", "eepctl", "scale", "--help"]),
        ("python -c pass (floor)", [sys.executable, "-c", "pass"]),
    ):
        t = timed(cmd, runs)
        print(f"{label:<24} runs={runs} min={min(t):.3f}s median={statistics.median(t):.3f}s max={max(t):.3f}s")


if __name__ == "__main__":
    main()
