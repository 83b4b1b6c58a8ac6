"""Small file-system primitives for the host cache: fcntl locks, fsync, atomic writes."""

from __future__ import annotations

import fcntl
import os
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
