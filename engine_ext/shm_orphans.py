"""Shared-memory segments of this host that nobody can use any more, found and removed.

vLLM's message queues are Python shared-memory segments (``multiprocessing.shared_memory``:
``/dev/shm/psm_*``, 160-240 MiB apiece, sparse). Python's resource tracker removes them when their
process exits, but not when it is killed: an elastic vLLM deployment whose Ray DP engine processes
are stopped leaves theirs behind, and they hold tmpfs memory until the host reboots.

A segment counts as an orphan only when all of these hold (a conservative reading: a false
orphan would break a live process):

* its name starts with ``psm_`` and it is a regular file owned by this user, private to it
  (no group or other permission bits: only this user's processes, or root's, can map it);
* it is at least ``min_age_s`` old (a segment is mapped within microseconds of being made, by
  the constructor that made it; ``since`` narrows further to those made since a moment);
* no process maps it or holds it open (``/proc/<pid>/maps`` and ``/proc/<pid>/fd``; a process
  this user may not inspect is passed over: it cannot map a file private to this user unless
  it runs as root).

Torch- and Ray-free: the test harness, ``eepctl repair`` (through one task per Ray node,
engine_ext.ray.shm_sweep) and an operator's script all use it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "psm_"
MIN_AGE_S = 5.0


@dataclass(frozen=True)
class Orphan:
    path: Path
    bytes: int  # the file's size (sparse: what it may hold, not what it holds)


def _candidates(directory: Path, prefix: str, since: float, min_age_s: float) -> list[Orphan]:
    uid, newest = os.getuid(), time.time() - min_age_s
    found = []
    for p in directory.glob(prefix + "*") if directory.is_dir() else []:
        with contextlib.suppress(OSError):
            st = p.lstat()
            private = stat.S_ISREG(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077
            if private and since <= st.st_ctime and max(st.st_ctime, st.st_mtime) <= newest:
                found.append(Orphan(p, st.st_size))
    return found


def _in_use(directory: Path, prefix: str) -> set[str]:
    """Names under ``directory`` with ``prefix`` that a process maps or holds open (a process that
    ends while we look, or that this user may not inspect, is passed over)."""
    used: set[str] = set()
    marker = f"{directory}/{prefix}"
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            with open(proc / "maps") as f:
                used.update(line.split(f"{directory}/", 1)[1].split(" ")[0].rstrip() for line in f if marker in line)
        with contextlib.suppress(OSError):
            for fd in os.listdir(proc / "fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(proc / "fd" / fd)
                    if link.startswith(marker):
                        used.add(link.split("/")[-1].removesuffix(" (deleted)"))
    return used


def orphan_segments(
    since: float = 0.0, min_age_s: float = MIN_AGE_S, prefix: str = PREFIX, directory: Path = SHM_DIR
) -> list[Orphan]:
    """The orphaned segments (the module's rules), oldest first."""
    found = _candidates(directory, prefix, since, min_age_s)
    if not found:
        return []
    used = _in_use(directory, prefix)
    return sorted((o for o in found if o.path.name not in used), key=lambda o: o.path.name)


def remove_orphan_segments(
    since: float = 0.0, min_age_s: float = MIN_AGE_S, prefix: str = PREFIX, directory: Path = SHM_DIR
) -> list[Orphan]:
    """Remove ``orphan_segments(...)``; those removed."""
    gone = []
    for o in orphan_segments(since, min_age_s, prefix, directory):
        with contextlib.suppress(FileNotFoundError):
            o.path.unlink()
            gone.append(o)
    return gone
