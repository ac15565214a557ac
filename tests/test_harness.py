"""The removal of orphaned shared-memory segments (engine_ext.shm_orphans): what killed processes
leave in /dev/shm (vLLM's queues) is removed by the test session at its end
(``conftest.no_orphan_shared_memory``) and by ``eepctl repair`` on a vLLM deployment, and nothing a
live process maps or holds open, nothing too young, nothing another user could share."""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from engine_ext.shm_orphans import SHM_DIR, orphan_segments, remove_orphan_segments

# A child that makes a segment as multiprocessing.shared_memory does (open, size, map) and waits.
CHILD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
m = mmap.mmap(fd, 1 << 20)
m[:4] = b"eep!"
print("mapped", flush=True)
time.sleep(600)
"""


def _names(since: float, min_age_s: float, directory: Path) -> set[str]:
    return {o.path.name for o in orphan_segments(since, min_age_s, directory=directory)}


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")
def test_a_killed_processs_segment_is_removed_and_one_in_use_kept():
    since = time.time() - 1
    # A directory of its own under /dev/shm: what other sessions make or leave meanwhile is not looked at.
    here = Path(tempfile.mkdtemp(prefix="eeptest-", dir=SHM_DIR))
    dead, live, held, shared = (here / f"psm_{tag}" for tag in ("dead", "live", "held", "shared"))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(dead)], stdout=subprocess.PIPE, text=True)
    fds = [
        os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        for p, mode in ((live, 0o600), (held, 0o600), (shared, 0o644))
    ]
    try:
        for fd in fds:
            os.ftruncate(fd, 1 << 20)
        os.fchmod(fds[2], 0o644)  # whatever the umask: readable by others
        ours = mmap.mmap(fds[0], 1 << 20)  # mapped by this live process: never an orphan
        os.close(fds.pop(2))  # ``shared``: nobody maps it, but another user's process could
        assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
        assert dead.name not in _names(since, 0, here)  # its maker lives and maps it
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        assert dead.exists()  # a SIGKILLed process unlinks nothing
        assert dead.name not in _names(since, 3600, here)  # too young: maybe being mapped
        assert _names(since, 0, here) & {dead.name, live.name, held.name, shared.name} == {dead.name}
        assert dead.name not in _names(time.time() + 60, 0, here)  # made before ``since``: kept
        removed = remove_orphan_segments(since, 0, directory=here)
        assert [(o.path.name, o.bytes) for o in removed] == [(dead.name, 1 << 20)]
        assert not dead.exists() and live.exists() and held.exists() and shared.exists()
        ours.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        for fd in fds:
            os.close(fd)
        shutil.rmtree(here, ignore_errors=True)
