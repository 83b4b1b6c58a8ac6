"""Small file-system primitives for the host cache: fcntl locks, fsync, atomic writes."""

from __future__ import annotations

import fcntl
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def flock(path: Path, mode: int = fcntl.LOCK_EX, blocking: bool = True) -> Iterator[bool]:
    """Hold an fcntl lock on ``path`` (threads too: each call opens its own file description)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, mode | (0 if blocking else fcntl.LOCK_NB))
            got = True
        except BlockingIOError:
            got = False
        yield got
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SyncedFile:
    """A binary file that is flushed and fsynced when closed without error."""

    def __init__(self, path: Path):
        self.path, self.f = path, open(path, "wb")

    def write(self, data: bytes) -> int:
        return self.f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.f.flush()
            os.fsync(self.f.fileno())
        self.f.close()


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with SyncedFile(tmp) as f:
        f.write(data)
    os.replace(tmp, path)


def file_identity(path: Path) -> tuple[int, int, int, int, int]:
    """(device, inode, size, mtime, ctime in ns): the same tuple means the same file, not written since.
    The ctime cannot be set back from user space, so restoring the mtime after a write does not hide it."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


SETTLE_NS = 2_000_000_000  # coarser than any file system's timestamp tick (1 s on some, 4 ms on most)


def unchanged(path: Path, before: tuple) -> bool:
    """The file still has identity ``before`` (False when it is gone: what was read from it stands, its
    identity does not)."""
    try:
        return file_identity(path) == before
    except OSError:
        return False


def settled(path: Path, before: tuple) -> bool:
    """The file still has identity ``before``, and its last change is older than any timestamp tick: a
    write in the same tick as the change that gave it that identity would not change it again (git's
    "racily clean" rule), so a file changed just now is never trusted by its identity."""
    return unchanged(path, before) and time.time_ns() - max(before[3], before[4]) > SETTLE_NS


def written_long_ago(before: tuple) -> bool:
    """The content of a file with identity ``before`` was last written (its mtime) longer ago than any
    timestamp tick, so any write from now on gives it another mtime. Only its status may have changed
    since (a hard link or a chmod moves the ctime, not the bytes): a hash read now stands for every read
    of the same identity."""
    return time.time_ns() - before[3] > SETTLE_NS
