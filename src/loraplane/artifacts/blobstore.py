"""The host cache's storage layer: the folder layout, content-addressed blobs, locks, pins and in-use marks.

``HostCache`` (cache.py) builds on it: pulls, verification of cached folders, LRU eviction. The layout and
the concurrency rules are described there.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.artifacts import s3 as S3
from loraplane.artifacts.fsutil import (
    SETTLE_NS,
    SyncedFile,
    file_identity,
    flock,
    fsync_dir,
    unchanged,
    written_long_ago,
)
from loraplane.artifacts.manifest import WEIGHTS_FILE, FileEntry, Manifest
from loraplane.artifacts.tensors import TensorScanner
from loraplane.artifacts.verify import hash_file

# Blobs whose verified identity a process remembers, least recently used dropped first: a forgotten one is
# hashed once more on its next hit.
VERIFIED_MAX = 4096


class BlobStore:
    """Files and locks under ``root``, shared by the threads of this process and by other processes."""

    def __init__(
        self, root: str | Path, s3_client=None, *, retry: S3.RetryPolicy | None, verify_on_hit: bool
    ):
        self.root = Path(root)
        # Check files on every hit (corruption is evicted and refetched): hashed, unless this process
        # verified the file and it kept its identity since (``check_file``).
        self.verify_on_hit = verify_on_hit
        self.verified_max = VERIFIED_MAX
        self.retry = retry or S3.RetryPolicy()
        self._client = s3_client
        self._mutex = threading.Lock()
        self._in_use: Counter[str] = Counter()
        self._use_fds: dict[str, int] = {}
        self.counters: Counter[str] = Counter()
        self._verified: OrderedDict[str, tuple] = OrderedDict()  # sha256 -> identity, least recent first
        for sub in ("blobs", "adapters", "tmp", "locks", "pins"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._sweep_tmp()

    # --- paths ---------------------------------------------------------------------------------------

    @property
    def client(self):
        if self._client is None:
            self._client = S3.make_client()
        return self._client

    def _blob(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256

    def _folder(self, hex_: str) -> Path:
        return self.root / "adapters" / hex_

    def _lock(self, kind: str, hex_: str) -> Path:
        return self.root / "locks" / f"{kind}-{hex_}.lock"

    def _count(self, key: str, n: int = 1) -> None:
        with self._mutex:
            self.counters[key] += n

    # --- blobs ---------------------------------------------------------------------------------------

    def _missing_bytes(self, manifest: Manifest) -> int:
        return sum(e.size for e in manifest.files.values() if not self._blob(e.sha256).is_file())

    def _ensure_blob(self, bucket: str, key: str, name: str, entry: FileEntry, dest: Path) -> None:
        """Hard-link the verified blob of the manifest's file ``name`` (``entry``) at ``dest``, downloading it
        from the object ``key`` once, however many pullers ask at the same time. Under the blob's lock: a
        cached blob is hashed there only when the memo cannot vouch for it (the others wait for that one hash
        and then find it remembered); the link moves the blob's ctime, which the memo follows."""
        blob = self._blob(entry.sha256)
        with flock(self._lock("blob", entry.sha256)):
            for _attempt in range(3):  # an evictor may drop an orphan blob between its check and its link
                if not self._usable(blob, name, entry):
                    self._download(bucket, key, name, entry, blob)
                if self._link(blob, dest, entry.sha256):
                    return
        raise E.ArtifactError(E.CACHE_FULL, "blob evicted repeatedly while assembling", name)

    def _usable(self, blob: Path, name: str, entry: FileEntry) -> bool:
        """A cached blob that holds the entry's bytes (under its lock); a corrupt one is removed (-> False)."""
        try:
            if blob.stat().st_size == entry.size and (
                not self.verify_on_hit or self.check_file(blob, name, entry.sha256)
            ):
                return True
        except FileNotFoundError:  # evicted while we looked
            return False
        self._count("corrupt_evictions")
        self._forget(entry.sha256)
        with suppress(FileNotFoundError):
            blob.unlink()
        return False

    def _download(self, bucket: str, key: str, name: str, entry: FileEntry, blob: Path) -> None:
        tmp = self.root / "tmp" / f"{entry.sha256}.{os.getpid()}.{threading.get_ident()}.part"
        try:
            S3.stream_verified(
                self.client,
                bucket,
                key,
                sha256=entry.sha256,
                size=entry.size,
                open_sink=lambda: SyncedFile(tmp),
                retry=self.retry,
                # the weights' layout and values are checked in the pass that hashes them
                new_check=(lambda: TensorScanner(entry.size, name)) if name == WEIGHTS_FILE else None,
                name=name,
            )
            # Its mtime goes back past any timestamp tick: a later write, in whatever tick, moves it.
            now = time.time_ns()
            os.utime(tmp, ns=(now, now - 2 * SETTLE_NS))
            os.chmod(tmp, 0o444)
            os.replace(tmp, blob)
            fsync_dir(blob.parent)
        finally:
            with suppress(FileNotFoundError):
                tmp.unlink()
        # Its bytes were hashed as this process wrote them (nobody else writes a .part of ours).
        self._remember(entry.sha256, file_identity(blob))
        self._count("downloads")
        self._count("bytes_downloaded", entry.size)

    def _link(self, blob: Path, dest: Path, sha256: str) -> bool:
        """Hard-link (else copy) ``blob`` at ``dest``; False when the blob is gone. Under the blob's lock."""
        vouched = self.verified_identity(blob, sha256)
        try:
            os.link(blob, dest)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            shutil.copyfile(blob, dest)
            return True
        if vouched is not None:  # the link moved the ctime; a write would also have moved the mtime
            with suppress(OSError):
                after = file_identity(blob)
                if after[:4] == vouched[:4]:
                    self._remember(sha256, after)
        return True

    # --- what this process verified ------------------------------------------------------------------

    def verified_identity(self, path: Path, sha256: str) -> tuple | None:
        """The identity of ``path`` (``fsutil.file_identity``) if this process verified that a file with this
        very identity holds the bytes of ``sha256``; None otherwise (then only a hash can tell)."""
        try:
            now = file_identity(path)
        except OSError:
            return None
        with self._mutex:
            if self._verified.get(sha256) != now:
                return None
            self._verified.move_to_end(sha256)
        return now

    def check_file(self, path: Path, name: str, sha256: str) -> bool:
        """Whether the file ``name`` at ``path`` holds the bytes of ``sha256``: vouched for by the memo, else
        hashed (and remembered when its content had settled before the hash began, and its identity held
        through it: a write in the same timestamp tick as the last one would leave the identity as it was)."""
        if self.verified_identity(path, sha256) is not None:
            return True
        before = file_identity(path)
        settled_before = written_long_ago(before)
        self._count("hash_passes")
        self._count("bytes_hashed", before[2])
        if hash_file(path, name, sha256) != sha256:
            return False
        if settled_before and unchanged(path, before):
            self._remember(sha256, before)
        return True

    def _remember(self, sha256: str, identity: tuple) -> None:
        with self._mutex:
            self._verified[sha256] = identity
            self._verified.move_to_end(sha256)
            while len(self._verified) > self.verified_max:
                self._verified.popitem(last=False)

    def _forget(self, sha256: str) -> None:
        with self._mutex:
            self._verified.pop(sha256, None)

    def used_bytes(self) -> int:
        return sum(e.stat().st_size for e in os.scandir(self.root / "blobs") if e.is_file())

    def _drop_orphan_blobs(self) -> None:
        """Blobs that no adapter links (a failed assembly) and nobody is writing."""
        for blob in os.scandir(self.root / "blobs"):
            with suppress(FileNotFoundError), flock(self._lock("blob", blob.name), blocking=False) as free:
                if free and blob.stat().st_nlink == 1 and time.time() - blob.stat().st_mtime > 60:
                    self._forget(blob.name)
                    os.unlink(blob.path)

    def _drop_unlinked_blobs(self, manifest: Manifest) -> None:
        """After a refusal: the manifest's blobs that no adapter folder links. One that another pull is
        writing (its lock is held) stays; a pull about to link one that goes fetches it again."""
        for entry in manifest.files.values():
            blob = self._blob(entry.sha256)
            with suppress(FileNotFoundError), flock(self._lock("blob", entry.sha256), blocking=False) as free:
                if free and blob.stat().st_nlink == 1:
                    self._forget(entry.sha256)
                    blob.unlink()

    # --- pins and in-use -----------------------------------------------------------------------------

    def pin(self, digest: str) -> None:
        (self.root / "pins" / digest.removeprefix("sha256:")).touch()

    def unpin(self, digest: str) -> None:
        with suppress(FileNotFoundError):
            (self.root / "pins" / digest.removeprefix("sha256:")).unlink()

    def is_pinned(self, digest: str) -> bool:
        return (self.root / "pins" / digest.removeprefix("sha256:")).exists()

    def acquire(self, digest: str) -> bool:
        """Mark an adapter in use (not evictable, also for other processes). False if it is not cached."""
        hex_ = digest.removeprefix("sha256:")
        with self._mutex:
            if self._in_use[digest] == 0:
                fd = os.open(self._lock("use", hex_), os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_SH)
                if not self._folder(hex_).is_dir():
                    os.close(fd)
                    return False
                self._use_fds[digest] = fd
            self._in_use[digest] += 1
            return True

    def release(self, digest: str) -> None:
        with self._mutex:
            if self._in_use[digest] <= 0:
                raise ValueError(f"release({digest}) without acquire")
            self._in_use[digest] -= 1
            if self._in_use[digest] == 0:
                del self._in_use[digest]
                os.close(self._use_fds.pop(digest))

    @contextmanager
    def in_use(self, digest: str) -> Iterator[None]:
        if not self.acquire(digest):
            raise E.ArtifactError(E.NOT_FOUND, f"{digest} is not in the cache", "cache")
        try:
            yield
        finally:
            self.release(digest)

    # --- housekeeping --------------------------------------------------------------------------------

    def _sweep_tmp(self) -> None:
        """Leftovers of pulls that died (kill -9, OOM kill), found at the next start of any pull.

        A download's ``<sha256>.<pid>.<thread>.part`` is written under its blob lock, and a folder under
        construction ``adapter-<digest>.<uuid>`` under its adapter lock: when that lock is free, the writer
        is gone. Eviction trash (``evicted-*``) is never read. Anything else goes after an hour."""
        cutoff = time.time() - 3600
        for entry in os.scandir(self.root / "tmp"):
            head = entry.name.split(".", 1)[0]
            with suppress(FileNotFoundError):
                if entry.name.endswith(".part") and _HEX64.fullmatch(head):
                    lock = self._lock("blob", head)
                elif entry.name.startswith("adapter-") and _HEX64.fullmatch(head.removeprefix("adapter-")):
                    lock = self._lock("adapter", head.removeprefix("adapter-"))
                elif entry.name.startswith("evicted-") or entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    lock = None
                else:
                    continue
                if lock is None:
                    _remove(entry)
                    continue
                with flock(lock, blocking=False) as writer_gone:
                    if writer_gone:
                        _remove(entry)
                        self._count("swept")


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _remove(entry: os.DirEntry) -> None:
    if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path, ignore_errors=True)
    else:
        with suppress(FileNotFoundError):
            os.unlink(entry.path)
