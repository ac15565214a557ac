"""CI fails, not skips, when a system tool the tests drive is missing and cannot be installed
(scripts/ci_tools.sh, run by .ci/run): a real bash run of the script with a PATH that holds only
what it is given."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "ci_tools.sh"


def _run(bin_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/")},
    )


def _bin(tmp_path: Path, tools: list[str]) -> Path:
    """A PATH directory with the script's own needs (``id``) and ``tools`` as stand-ins that exist."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "id").symlink_to(shutil.which("id") or "/usr/bin/id")
    for t in tools:
        (d / t).write_text("#!/bin/sh\nexit 0\n")
        (d / t).chmod(0o755)
    return d


def test_a_tool_that_cannot_be_installed_fails_the_run(tmp_path: Path) -> None:
    res = _run(_bin(tmp_path, ["ip", "zsh", "tmux"]))  # no fish, and no apt-get to install it
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert "`fish` (Debian package fish) is missing and could not be installed" in res.stderr, res.stderr


def test_every_tool_present_passes(tmp_path: Path) -> None:
    res = _run(_bin(tmp_path, ["ip", "zsh", "fish", "tmux"]))
    assert res.returncode == 0 and res.stderr == "", (res.returncode, res.stderr)
