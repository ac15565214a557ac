"""Shared-memory files of one host: where they live, their creation and removal, and whether
the process that uses one still runs. Torch-free (the orphan sweep and the controller side read it)."""

from __future__ import annotations

import mmap
import os
import uuid


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class ShmError(RuntimeError):
    """A shared-memory collective failed: ``code`` is "timeout", "peer_gone", "aborted" or "overflow"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie — killed, not yet reaped — counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return True


def create_file(tag: str, nbytes: int) -> tuple[str, mmap.mmap]:
    """A new shared-memory file ``<shm_dir>/<tag>-<pid>-<random>`` of ``nbytes``, mapped. Every byte
    is reserved before it is returned, so a full tmpfs fails here (``ShmError`` "overflow", the
    file removed) instead of a later write dying of SIGBUS."""
    path = os.path.join(shm_dir(), f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return path, mmap.mmap(fd, nbytes)
        except OSError as ex:
            remove_file(path)
            raise ShmError("overflow", f"shm file of {nbytes} bytes: {path}: {ex}") from ex
    finally:
        os.close(fd)


def remove_file(path: str) -> None:
    """Remove a shared-memory file's name (its mappings stay valid); one already removed is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
