"""The test harness's own clean-up: what the tests' stopped processes leave in /dev/shm is removed
at the session's end (``conftest.no_orphan_shared_memory``), and nothing a live process maps."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import SHM_DIR, orphan_segments, remove_orphan_segments

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


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")
def test_a_killed_processs_segment_is_removed_and_a_mapped_one_kept():
    since = time.time() - 1
    dead, live = (SHM_DIR / f"psm_eeptest{os.getpid()}{tag}" for tag in ("dead", "live"))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(dead)], stdout=subprocess.PIPE, text=True)
    fd = os.open(live, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        ours = mmap.mmap(fd, 1 << 20)  # mapped by this live process: never an orphan
        assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
        assert dead.name not in {p.name for p in orphan_segments(since, min_age_s=0)}  # its maker lives and maps it
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        assert dead.exists()  # a SIGKILLed process unlinks nothing
        assert dead.name not in {p.name for p in orphan_segments(since, min_age_s=3600)}  # too young: maybe being mapped
        assert {p.name for p in orphan_segments(since, min_age_s=0)} >= {dead.name}
        assert live.name not in {p.name for p in orphan_segments(since, min_age_s=0)}
        assert dead.name not in {p.name for p in orphan_segments(time.time() + 60, min_age_s=0)}  # made before: kept
        assert dead.name in remove_orphan_segments(since, min_age_s=0)
        assert not dead.exists() and live.exists()
        ours.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        os.close(fd)
        for p in (dead, live):
            p.unlink(missing_ok=True)
