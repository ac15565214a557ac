"""Shell completion: the committed scripts match the CLI and complete in a real bash, a real zsh
(an interactive zsh in a tmux pane, Tab pressed, the screen read) and a real fish (its own
``complete -C``). zsh and fish come from the distribution (.ci/run installs them); a test is
skipped, saying why, only where the shell is not installed.

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
from typing import Any

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
    return subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", prog],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


def _need(shell: str) -> str:
    path = shutil.which(shell)
    if path is None:
        pytest.skip(f"{shell} is not installed (apt-get install -y {shell}; .ci/run does it)")
    return path


def _fish_complete(line: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """fish's own completion engine on ``line``, with the committed script loaded."""
    fish = _need("fish")
    script = ROOT / "completions" / "eepctl.fish"
    prog = f"source {shlex.quote(str(script))}; complete -C {shlex.quote(line)}"
    return subprocess.run(
        [fish, "--no-config", "-c", prog], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


class ZshPane:
    """An interactive zsh (compinit, the committed script) in a tmux pane on a private tmux
    server; ``complete`` types a line, presses Tab and returns the screen."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        zsh, self.tmux = _need("zsh"), shutil.which("tmux")
        if self.tmux is None:
            pytest.skip("tmux is not installed: the zsh test drives an interactive zsh through it")
        zdot = tmp_path / "zdot"
        zdot.mkdir()
        (zdot / ".zshrc").write_text(
            "autoload -U compinit && compinit -u -d " + shlex.quote(str(zdot / ".zcompdump")) + "\n"
            f"source {shlex.quote(str(ROOT / 'completions' / 'eepctl.zsh'))}\n"
            "PS1='READY> '\n"
        )
        self.sock = f"eep-zsh-{os.getpid()}-{time.monotonic_ns()}"
        self.env = dict(env, ZDOTDIR=str(zdot), TERM="xterm-256color")
        self._tmux("new-session", "-d", "-x", "200", "-y", "50", f"{zsh} -i")
        self._wait(lambda screen: "READY>" in screen, "the zsh prompt")

    def _tmux(self, *args: str) -> str:
        res = subprocess.run(
            [self.tmux, "-L", self.sock, *args], capture_output=True, text=True, env=self.env, timeout=30, cwd=ROOT
        )
        assert res.returncode == 0, res.stderr
        return res.stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p")

    def _wait(self, pred: Any, what: str, timeout: float = 30.0) -> str:
        deadline = time.time() + timeout
        while True:
            screen = self.screen()
            if pred(screen) or time.time() > deadline:
                assert pred(screen), f"timed out waiting for {what}; screen:\n{screen}"
                return screen
            time.sleep(0.2)

    def complete(self, line: str, until: Any, what: str) -> str:
        self._tmux("send-keys", "C-u")
        self._tmux("send-keys", "-l", line)
        self._tmux("send-keys", "Tab")
        return self._wait(until, what)

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.sock, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def zsh_pane(tmp_path: Path) -> Any:
    panes: list[ZshPane] = []

    def make(env: dict[str, str]) -> ZshPane:
        panes.append(ZshPane(tmp_path, env))
        return panes[-1]

    yield make
    for p in panes:
        p.close()


# ---- the committed scripts ---------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_committed_scripts_match_the_cli(tmp_path: Path) -> None:
    """CI drift check: regenerate with scripts/gen_completions.sh and compare byte for byte."""
    out = tmp_path / "gen"
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_completions.sh"), str(out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHON=sys.executable),
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    for shell in SHELLS:
        committed = (ROOT / "completions" / f"eepctl.{shell}").read_text()
        fresh = (out / f"eepctl.{shell}").read_text()
        assert fresh == committed, (
            f"completions/eepctl.{shell} drifted from the CLI: run scripts/gen_completions.sh and commit the result"
        )


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
    print(
        f"\ncompletion of `eepctl status --name ` with no cluster ({ray_address or 'RAY_ADDRESS unset'}): "
        f"{wall * 1000:.0f} ms wall (bash + python + eepctl)"
    )
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


# ---- a real zsh and a real fish ------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_zsh_completes_subcommand_and_scale_options(tmp_path: Path, zsh_pane: Any) -> None:
    pane = zsh_pane(_env(tmp_path, RAY_ADDRESS="127.0.0.1:1"))
    screen = pane.complete("eepctl sc", lambda s: "READY> eepctl scale" in s, "`eepctl sc` -> scale")
    assert "READY> eepctl scale" in screen.splitlines()  # the whole word (tmux drops the trailing space)
    screen = pane.complete(
        "eepctl scale --d", lambda s: "--drain-timeout" in s and "--dry-run" in s, "scale's --d... options listed"
    )
    for opt in ("--dp", "--dry-run", "--drain-timeout"):
        assert opt in screen
    assert "--no-wait" not in screen  # only the ones matching what was typed


@pytest.mark.timeout(60)
def test_fish_completes_subcommand_and_scale_options(tmp_path: Path) -> None:
    env = _env(tmp_path, RAY_ADDRESS="127.0.0.1:1")
    res = _fish_complete("eepctl sc", env)
    assert res.returncode == 0, res.stderr
    assert [ln.split("\t")[0] for ln in res.stdout.splitlines()] == ["scale"]
    res = _fish_complete("eepctl scale --", env)
    offered = {ln.split("\t")[0] for ln in res.stdout.splitlines()}
    for opt in ("--dp", "--dry-run", "--drain-timeout", "--no-wait", "--timeout", "--name", "--output", "--help"):
        assert opt in offered, f"{opt} not offered: {sorted(offered)}"
    assert res.stderr == ""


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
        if shutil.which("fish"):
            res = _fish_complete("eepctl status --name comp", env)
            assert [ln.split("\t")[0] for ln in res.stdout.splitlines()] == [name], (res.stdout, res.stderr)
        if shutil.which("zsh") and shutil.which("tmux"):
            pane = ZshPane(tmp_path, env)
            try:
                screen = pane.complete(
                    "eepctl status --name comp", lambda s: f"--name {name}" in s, "the deployment name in zsh"
                )
                assert f"READY> eepctl status --name {name}" in screen.splitlines()
            finally:
                pane.close()
    finally:
        down = eepctl("down", "--name", name, timeout=300)
        assert down.returncode == 0, down.stderr
