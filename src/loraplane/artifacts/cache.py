"""The host cache: verified adapter folders on a node, content-addressed, shared by processes.

Layout under ``root``::

    blobs/<sha256>          read-only file content, named by its hash (shared by every adapter using it)
    adapters/<digest-hex>/  one folder per verified adapter version: hard links to blobs, plus the
                            manifest and signature bytes. Built in tmp/ and renamed into place whole,
                            so a folder here only ever holds verified files.
    tmp/                    downloads and folders under construction (fsync, then rename)
    locks/                  fcntl lock files: one per blob and per adapter (pulls), one per in-use adapter
    pins/<digest-hex>       pinned adapters are never evicted

Concurrency: a pull takes the adapter's lock, then each missing blob's lock, so concurrent pulls of one
adapter (threads or processes) download each file once and the others wait. Budget: blob bytes; before a
download, least recently used adapters that are neither pinned nor in use are evicted (a blob goes when no
adapter links it any more). Pulls of different adapters running at once can overshoot by their in-flight size.

Checks on a hit (``verify_on_hit``, the default): a cached file is hashed again unless this process
verified it (downloaded it from a verified stream, or hashed it once its content had settled) and it kept
its identity since (``fsutil.file_identity``: device, inode, size, mtime, ctime). Any write changes the
identity, so a changed file is hashed, and a corrupt one evicted and fetched again; bit rot that changes no
timestamp is caught only by a hash, i.e. by another process or after the memo forgot the blob. The memo
holds the most recently used ``VERIFIED_MAX`` blobs and forgets a blob this process removes. Removing
another folder's link to a shared blob moves its ctime too: its next hit hashes it once more.

Split: blobstore.py holds the storage layer (layout, blobs, locks, pins, in-use marks); this module adds
pulls, the verification of cached folders and LRU eviction.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.artifacts import s3 as S3
from loraplane.artifacts.blobstore import BlobStore
from loraplane.artifacts.fsutil import flock, fsync_dir, write_atomic
from loraplane.artifacts.manifest import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    WEIGHTS_FILE,
    Manifest,
)
from loraplane.artifacts.verify import (
    DEFAULT_MAX_FILE_BYTES,
    Policy,
    VerifiedManifest,
    check_folder_contents,
    fetch_verified_manifest,
    verify_manifest_bytes,
)

log = logging.getLogger(__name__)

# A cached folder was fully verified when it was built, so these failures on a later read mean the local
# copy changed (bit rot, a stray write): evict and fetch again. UnknownKey, BaseMismatch and other policy
# refusals mean "not for this caller" and leave the entry alone.
_CORRUPTION = frozenset(
    {
        E.FILE_HASH_MISMATCH,
        E.FILE_SIZE_MISMATCH,
        E.MISSING_FILE,
        E.BAD_MANIFEST,
        E.DIGEST_MISMATCH,
        E.UNSIGNED,
        E.BAD_SIGNATURE,
    }
)

# Counters ``stats`` shows. hash_passes / bytes_hashed: cached files hashed again on a hit (the memo could not
# vouch for them); a download's own hash is not counted.
_STATS = ("hits", "misses", "downloads", "bytes_downloaded", "evictions", "corrupt_evictions", "hash_passes",
          "bytes_hashed")  # fmt: skip


@dataclass(frozen=True, slots=True)
class LocalAdapter:
    path: Path  # verified folder: adapter_config.json, adapter_model.safetensors, manifest, signature
    manifest: Manifest
    digest: str  # "sha256:<hex>"
    key_id: str

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE

    @property
    def config_path(self) -> Path:
        return self.path / "adapter_config.json"


class HostCache(BlobStore):
    def __init__(
        self,
        root: str | Path,
        budget_bytes: int,
        s3_client=None,
        *,
        retry: S3.RetryPolicy | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        verify_on_hit: bool = True,
        room_wait_s: float = 0.0,
    ):
        if budget_bytes <= 0:
            raise ValueError("HostCache.budget_bytes must be positive")
        if room_wait_s < 0:
            raise ValueError("HostCache.room_wait_s must be >= 0")
        self.budget_bytes = budget_bytes
        # A pull that finds the budget held by adapters in use (being loaded: the use ends on its own) waits
        # up to this long for them, instead of failing a burst of pulls that the budget serves one after
        # another. Room held by pinned adapters is never waited for.
        self.room_wait_s = room_wait_s
        self.max_file_bytes = max_file_bytes
        super().__init__(root, s3_client, retry=retry, verify_on_hit=verify_on_hit)

    # --- pull ----------------------------------------------------------------------------------------

    def pull(
        self,
        uri: str,
        *,
        trusted_keys: Mapping[str, bytes],
        expected_base_hash: str | None,
        pinned_digest: str | None = None,
        max_rank: int | None = None,
        allowed_modules: set[str] | frozenset[str] | None = None,
        acquire: bool = False,
    ) -> LocalAdapter:
        """A verified local folder for the adapter at ``uri``, downloading only what the cache lacks.

        With a pinned digest and a cached copy, S3 is not contacted (the copy is re-verified instead).
        ``acquire=True`` marks the result in use before returning; call ``release(digest)`` when done.
        """
        policy = Policy(expected_base_hash, pinned_digest, max_rank, allowed_modules, self.max_file_bytes)
        self._sweep_tmp()  # what pulls killed earlier (kill -9) left behind, outside the byte budget
        if policy.pinned_digest is not None:
            local = self._open_local(
                policy.pinned_digest.removeprefix("sha256:"), trusted_keys, policy, acquire
            )
            if local is not None:
                return local
        verified = fetch_verified_manifest(
            uri,
            trusted_keys=trusted_keys,
            expected_base_hash=policy.expected_base_hash,
            pinned_digest=policy.pinned_digest,
            max_rank=max_rank,
            allowed_modules=policy.allowed_modules,
            max_file_bytes=self.max_file_bytes,
            s3_client=self.client,
            retry=self.retry,
        )
        hex_ = verified.digest.removeprefix("sha256:")
        with flock(self._lock("adapter", hex_)):
            local = self._open_local(hex_, trusted_keys, policy, acquire)
            if local is not None:
                return local
            self._count("misses")
            bucket, _ = S3.parse_s3_uri(uri)
            self._make_room(verified.manifest, keep=hex_)
            self._assemble(hex_, verified, bucket, policy)
            local = self._open_local(hex_, trusted_keys, policy, acquire, rehash=False)
        if local is None:  # evicted by someone else in between: rare, and a fresh pull fixes it
            raise E.ArtifactError(E.CACHE_FULL, "the adapter was evicted while being pulled", "cache")
        return local

    def _open_local(
        self, hex_: str, trusted_keys, policy: Policy, acquire: bool, rehash: bool | None = None
    ) -> LocalAdapter | None:
        """The cached folder if it exists and still verifies; a corrupt one is evicted (-> None)."""
        folder = self._folder(hex_)
        if not folder.is_dir():
            return None
        read = lambda name: (folder / name).read_bytes() if (folder / name).is_file() else None
        try:
            manifest_bytes, sig_bytes = read(MANIFEST_FILE), read(SIGNATURE_FILE)
        except FileNotFoundError:  # evicted by another puller while we looked
            return None
        try:
            verified = verify_manifest_bytes(
                manifest_bytes, sig_bytes, trusted_keys=trusted_keys, policy=policy
            )
            if verified.digest != "sha256:" + hex_:
                raise E.ArtifactError(E.DIGEST_MISMATCH, "cached manifest is not the one named", "cache")
            self._check_files(folder, verified.manifest, self.verify_on_hit if rehash is None else rehash)
        except E.ArtifactError as exc:
            if exc.reason in _CORRUPTION:
                log.warning("cache entry %s is corrupt (%s): evicting and fetching again", hex_[:16], exc)
                self._count("corrupt_evictions")
                self._evict(hex_, drop_blobs_of=folder)
                return None
            raise  # a valid entry that this caller must not use (other base, untrusted key, ...)
        if acquire and not self.acquire(verified.digest):
            return None
        self._count("hits")
        with suppress(FileNotFoundError):
            os.utime(folder)  # LRU clock
        return LocalAdapter(folder, verified.manifest, verified.digest, verified.key_id)

    def _check_files(self, folder: Path, manifest: Manifest, rehash: bool) -> None:
        for name, entry in manifest.files.items():
            path = folder / name
            if not path.is_file():
                raise E.ArtifactError(E.MISSING_FILE, "missing from the cached folder", name)
            if path.stat().st_size != entry.size:
                raise E.ArtifactError(E.FILE_SIZE_MISMATCH, "cached size differs", name)
            if rehash and not self.check_file(path, name, entry.sha256):
                raise E.ArtifactError(E.FILE_HASH_MISMATCH, "cached content differs", name)

    def _assemble(self, hex_: str, verified: VerifiedManifest, bucket: str, policy: Policy) -> None:
        """Build the adapter folder in tmp/ from verified blobs, compare its files with the manifest, rename it in.
        A refusal removes the blobs it downloaded that no other adapter links. Each file comes from the object
        fetch_verified_manifest located: its S3 blob, or the artifact's prefix (artifacts pushed before blobs)."""
        build = self.root / "tmp" / f"adapter-{hex_}.{uuid.uuid4().hex}"
        build.mkdir()
        try:
            for name, entry in verified.manifest.files.items():
                self._ensure_blob(bucket, verified.locations[name].key, name, entry, build / name)
            write_atomic(build / MANIFEST_FILE, verified.manifest_bytes)
            write_atomic(build / SIGNATURE_FILE, verified.signature_bytes)
            check_folder_contents(build, verified.manifest, policy)
            fsync_dir(build)
            os.rename(build, self._folder(hex_))
            fsync_dir(self._folder(hex_).parent)
        except E.ArtifactError as exc:
            shutil.rmtree(build, ignore_errors=True)
            if not exc.transient:  # refused: nothing of it stays (a transient failure keeps what it fetched)
                self._drop_unlinked_blobs(verified.manifest)
            raise
        finally:
            if build.exists():
                shutil.rmtree(build, ignore_errors=True)

    # --- budget and eviction -------------------------------------------------------------------------

    def _make_room(self, manifest: Manifest, keep: str) -> None:
        need = self._missing_bytes(manifest)
        if need > self.budget_bytes:
            raise E.ArtifactError(
                E.CACHE_FULL, f"needs {need} bytes, the budget is {self.budget_bytes}", "cache"
            )
        deadline = time.monotonic() + self.room_wait_s
        while True:
            with flock(self.root / "locks" / "cache.lock"):
                self._drop_orphan_blobs()
                for hex_ in self._lru_order():
                    if self.used_bytes() + need <= self.budget_bytes:
                        return
                    if hex_ != keep:
                        self._evict_if_idle(hex_)
                used = self.used_bytes()
                if used + need <= self.budget_bytes:
                    return
                pinned = self._pinned_bytes()
            if pinned + need > self.budget_bytes or time.monotonic() >= deadline:
                raise E.ArtifactError(
                    E.CACHE_FULL,
                    f"needs {need} bytes; {used} of {self.budget_bytes} are held by pinned or in-use adapters",
                    "cache",
                )
            time.sleep(0.05)  # outside the cache lock: the adapters in use end their loads meanwhile
            need = self._missing_bytes(manifest)  # a pull beside this one may have brought shared blobs

    def _pinned_bytes(self) -> int:
        """Bytes of the pinned adapters' files (a blob two of them share counts twice: an upper bound)."""
        total = 0
        for pin in os.scandir(self.root / "pins"):  # a pin may name a version not (or no longer) cached
            with suppress(FileNotFoundError):
                total += sum(f.stat().st_size for f in os.scandir(self._folder(pin.name)) if f.is_file())
        return total

    def _lru_order(self) -> list[str]:
        entries = [(e.stat().st_mtime, e.name) for e in os.scandir(self.root / "adapters") if e.is_dir()]
        return [name for _, name in sorted(entries)]

    def _evict_if_idle(self, hex_: str) -> bool:
        if self.is_pinned("sha256:" + hex_) or self._in_use["sha256:" + hex_]:
            return False
        with flock(self._lock("adapter", hex_), blocking=False) as got_adapter:
            if not got_adapter:
                return False
            with flock(self._lock("use", hex_), blocking=False) as idle:  # other processes hold LOCK_SH
                if not idle:
                    return False
                self._evict(hex_, drop_blobs_of=None)
                return True

    def _evict(self, hex_: str, drop_blobs_of: Path | None) -> None:
        """Remove the folder (renamed away first, so it vanishes at once), then its now-unlinked blobs."""
        folder = self._folder(hex_)
        corrupt_blobs = []
        if drop_blobs_of is not None:  # a corrupt entry: its blobs are suspect too
            for entry in drop_blobs_of.iterdir():
                with suppress(OSError):
                    corrupt_blobs.append(entry.stat().st_ino)
        trash = self.root / "tmp" / f"evicted-{hex_}.{uuid.uuid4().hex}"
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)
        self._count("evictions")
        for blob in os.scandir(self.root / "blobs"):
            with suppress(FileNotFoundError):
                st = blob.stat()
                if st.st_ino in corrupt_blobs or st.st_nlink == 1:
                    self._forget(blob.name)
                    os.unlink(blob.path)

    def evict(self, digest: str) -> bool:
        """Evict one adapter now unless it is pinned or in use."""
        with flock(self.root / "locks" / "cache.lock"):
            return self._evict_if_idle(digest.removeprefix("sha256:"))

    # --- introspection -------------------------------------------------------------------------------

    def entries(self) -> list[dict]:
        out = []
        for hex_ in self._lru_order():
            folder = self._folder(hex_)
            with suppress(FileNotFoundError):
                manifest = Manifest.from_json((folder / MANIFEST_FILE).read_bytes())
                digest = "sha256:" + hex_
                out.append(
                    {
                        "digest": digest,
                        "name": manifest.name,
                        "version": manifest.version,
                        "bytes": manifest.total_bytes,
                        "pinned": self.is_pinned(digest),
                        "in_use": self._in_use[digest],
                        "last_used": folder.stat().st_mtime,
                        "path": str(folder),
                    }
                )
        return out

    def stats(self) -> dict:
        entries = self.entries()
        with self._mutex:
            counters = dict(self.counters)
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes(),
            "adapters": len(entries),
            "blobs": sum(1 for _ in os.scandir(self.root / "blobs")),
            "pinned": sum(e["pinned"] for e in entries),
            "in_use": sum(1 for e in entries if e["in_use"]),
            **{k: counters.get(k, 0) for k in _STATS},
        }
