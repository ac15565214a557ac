"""Shell completion: the committed scripts match the CLI, and the bash one completes in a real bash.

The completion function a script defines runs `eepctl` from PATH with typer/click's completion
protocol (_EEPCTL_COMPLETE); the tests put this interpreter's bin directory first in PATH.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, eepctl

SHELLS = ("bash", "zsh", "fish")
BIN = Path(sys.executable).parent


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "EEPCTL_NAME", "EEPCTL_NAMESPACE")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    env["EEPCTL_STATE_DIR"] = str(state)
    env.update(extra)
    return env


def _bash_complete(words: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Source the committed bash script in a real bash, set COMP_WORDS/COMP_CWORD, call its
    function, print COMPREPLY one per line."""
    script = ROOT / "completions" / "eepctl.bash"
    words_arr = " ".join(shlex.quote(w) for w in words)
    prog = (
        f"source {shlex.quote(str(script))}\n"
        f"COMP_WORDS=({words_arr})\n"
        f"COMP_CWORD={len(words) - 1}\n"
        "_eepctl_completion eepctl\n"
        'for w in "${COMPREPLY[@]}"; do printf "%s\\n" "$w"; done\n'
    )
    assert shutil.which("eepctl", path=env["PATH"]), "eepctl is not installed next to this interpreter"
    return subprocess.run(["bash", "--norc", "--noprofile", "-c", prog], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


# ---- the committed scripts ---------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_committed_scripts_match_the_cli(tmp_path: Path) -> None:
    """CI drift check: regenerate with scripts/gen_completions.sh and compare byte for byte."""
    out = tmp_path / "gen"
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gen_completions.sh"), str(out)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHON=sys.executable), cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    for shell in SHELLS:
        committed = (ROOT / "completions" / f"eepctl.{shell}").read_text()
        fresh = (out / f"eepctl.{shell}").read_text()
        assert fresh == committed, (f"completions/eepctl.{shell} drifted from the CLI: "
                                    "run scripts/gen_completions.sh and commit the result")


# ---- a real bash ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_bash_completes_subcommand(tmp_path: Path) -> None:
    res = _bash_complete(["eepctl", "sc"], _env(tmp_path, RAY_ADDRESS="127.0.0.1:1"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["scale"]
    assert res.stderr == ""


@pytest.mark.timeout(60)
def test_bash_completes_scale_options(tmp_path: Path) -> None:
    res = _bash_complete(["eepctl", "scale", "--"], _env(tmp_path, RAY_ADDRESS="127.0.0.1:1"))
    assert res.returncode == 0, res.stderr
    offered = set(res.stdout.split())
    for opt in ("--dp", "--dry-run", "--drain-timeout", "--no-wait", "--timeout", "--name", "--output", "--help"):
        assert opt in offered, f"{opt} not offered: {sorted(offered)}"
    assert all(o.startswith("--") for o in offered)
    assert res.stderr == ""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ray_address", [None, "127.0.0.1:1"], ids=["no-address", "dead-address"])
def test_name_completion_without_a_cluster_is_instant_and_silent(tmp_path: Path, ray_address: str | None) -> None:
    extra = {"RAY_ADDRESS": ray_address} if ray_address else {}
    env = _env(tmp_path, **extra)
    t0 = time.perf_counter()
    res = _bash_complete(["eepctl", "status", "--name", ""], env)
    wall = time.perf_counter() - t0
    print(f"\ncompletion of `eepctl status --name ` with no cluster ({ray_address or 'RAY_ADDRESS unset'}): "
          f"{wall * 1000:.0f} ms wall (bash + python + eepctl)")
    assert res.returncode == 0
    assert res.stdout.strip() == ""
    assert res.stderr == "", res.stderr
    assert wall < 2.0, f"completion took {wall:.2f}s"


@pytest.mark.timeout(60)
def test_subcommand_completion_imports_neither_ray_nor_torch(tmp_path: Path) -> None:
    env = _env(tmp_path, RAY_ADDRESS="127.0.0.1:1", PYTHONPROFILEIMPORTTIME="1")
    res = _bash_complete(["eepctl", "sc"], env)
    assert res.stdout.split() == ["scale"]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("import time:")]
    assert len(lines) > 20, "PYTHONPROFILEIMPORTTIME produced no import log"
    modules = [ln.rsplit("|", 1)[-1].strip() for ln in lines]
    heavy = [m for m in modules if m.split(".")[0] in ("ray", "torch")]
    assert not heavy, f"completion imported {heavy[:5]}"


# ---- names from a reachable cluster ----------------------------------------------------------
@pytest.mark.timeout(360)
@pytest.mark.ray
def test_name_completion_from_a_reachable_cluster(ray_cluster: dict, tmp_path: Path) -> None:
    name = "compl-a"
    up = eepctl("up", "--dp", "1", "--name", name, timeout=300)
    try:
        assert up.returncode == 0, up.stderr
        env = _env(tmp_path, RAY_ADDRESS=ray_cluster["address"])
        t0 = time.perf_counter()
        res = _bash_complete(["eepctl", "status", "--name", "comp"], env)
        wall = time.perf_counter() - t0
        print(f"\ncompletion of `eepctl status --name comp` against a live cluster: {wall * 1000:.0f} ms wall")
        assert res.returncode == 0
        assert res.stdout.split() == [name], (res.stdout, res.stderr)
        assert res.stderr == "", res.stderr  # nothing from Ray on the operator's terminal
        res = _bash_complete(["eepctl", "scale", "-n", "zz"], env)
        assert res.stdout.strip() == ""
    finally:
        down = eepctl("down", "--name", name, timeout=300)
        assert down.returncode == 0, down.stderr
