"""Where adapter weights come from: ``s3://`` through the host cache, or a local PEFT folder.

Both paths end in a folder the engine may load and the manifest digest that names the version. An S3
version registered lazily is first only inspected (its manifest fetched and verified, no weights), and
pulled when its first request needs it. S3 adapters
are always signed: the host cache verifies the signature against the trusted keys, the base hash against the
loaded base and every file's hash while it streams, then every file is checked once more in the cached
folder before the engine reads it: hashed, unless this process verified that very file (same inode, size,
mtime and ctime) before. The engine is told the weights file's hash and identity as verified, so its load
hashes the file only if it changed since. Local folders (``loraplane serve --adapter name=DIR``) must be signed when
trusted keys are configured; without any (local development) an unsigned folder is accepted once its
shapes fit the base, and the log says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.artifacts.manifest import MANIFEST_FILE, SIGNATURE_FILE, WEIGHTS_FILE
from loraplane.artifacts.verify import Policy, fetch_verified_manifest, verify_folder
from loraplane.engine.api import EngineInfo, VerifiedFile
from loraplane.http.adapters import LoadSpec

log = logging.getLogger("loraplane.serve.sources")
DEFAULT_HOST_CACHE_BYTES = 16 << 30
ROOM_WAIT_S = 10.0  # a pull into a cache held by loads under way waits for them (artifacts.cache.HostCache)


@dataclass(frozen=True, slots=True)
class LocalPull:
    path: Path
    digest: str  # "sha256:<hex>" of the signed manifest, or of the weights file for an unsigned folder
    version: str
    download_s: float = 0.0
    verify_s: float = 0.0
    weights: VerifiedFile | None = None  # the weights file as verified, when its identity is known


@dataclass(frozen=True, slots=True)
class RemoteManifest:
    """What a lazy registration knows of a version before its files are pulled: all from the signed manifest."""

    digest: str  # "sha256:<hex>"
    ranks: dict[str, int]  # module -> rank
    nbytes: int  # every file's bytes: what the pull brings


def policy_for(info: EngineInfo, pinned_digest: str | None = None) -> Policy:
    base = info.base_hash if len(info.base_hash) == 64 else None  # an in-memory base has no hash to compare
    modules = frozenset(info.target_modules) or None  # an engine without adapters refuses them itself
    return Policy(base, pinned_digest, info.max_lora_rank or None, modules)


class S3Source:
    """Pulls through a HostCache under ``<host-cache-dir>/adapters``; blocking (run it in a thread)."""

    def __init__(self, cache, trusted_keys: dict[str, bytes], info_fn) -> None:
        self.cache, self.trusted_keys, self.info_fn = cache, trusted_keys, info_fn

    @classmethod
    def create(cls, cache_dir: str | Path, budget_bytes: int | None, trusted_keys, info_fn) -> S3Source:
        from loraplane.artifacts.cache import HostCache

        cache = HostCache(Path(cache_dir) / "adapters", budget_bytes or DEFAULT_HOST_CACHE_BYTES,
                          room_wait_s=ROOM_WAIT_S)  # fmt: skip
        return cls(cache, trusted_keys, info_fn)

    def pull(self, spec: LoadSpec) -> LocalPull:
        policy = policy_for(self.info_fn(), spec.digest)
        started = time.perf_counter()
        local = self.cache.pull(spec.uri, **self._checks(policy, spec), acquire=True)
        download_s = time.perf_counter() - started
        try:
            _check_identity(local.manifest, spec)
            started = time.perf_counter()
            verify_folder(
                local.path, trusted_keys=self.trusted_keys, policy=policy, holds=self.cache.check_file
            )
            verify_s = time.perf_counter() - started
        except BaseException:
            self.cache.release(local.digest)
            raise
        sha256 = local.manifest.files[WEIGHTS_FILE].sha256
        file_id = self.cache.verified_identity(local.weights_path, sha256)
        weights = VerifiedFile("sha256:" + sha256, file_id) if file_id is not None else None
        return LocalPull(local.path, local.digest, local.manifest.version, download_s, verify_s, weights)

    def inspect(self, spec: LoadSpec) -> RemoteManifest:
        """Verify the version's manifest in S3 (signature, base hash, ranks and modules against the engine,
        the pinned digest, its name and version, the listed files' sizes) without pulling its files."""
        policy = policy_for(self.info_fn(), spec.digest)
        verified = fetch_verified_manifest(
            spec.uri,
            **self._checks(policy, spec),
            max_file_bytes=self.cache.max_file_bytes,
            s3_client=self.cache.client,
            retry=self.cache.retry,
        )
        manifest = verified.manifest
        _check_identity(manifest, spec)
        return RemoteManifest(verified.digest, dict(manifest.ranks), manifest.total_bytes)

    def _checks(self, policy, spec: LoadSpec) -> dict:
        """What a pull and a manifest check both hold the artifact to."""
        return dict(trusted_keys=self.trusted_keys, expected_base_hash=policy.expected_base_hash,
                    pinned_digest=spec.digest, max_rank=policy.max_rank,
                    allowed_modules=policy.allowed_modules)  # fmt: skip

    def release(self, digest: str) -> None:
        self.cache.release(digest)

    def pin(self, digest: str, pinned: bool) -> None:
        (self.cache.pin if pinned else self.cache.unpin)(digest)


def _check_identity(manifest, spec: LoadSpec) -> None:
    if manifest.name != spec.name or manifest.version != spec.version:
        raise E.ArtifactError(E.BAD_MANIFEST, f"the manifest names {manifest.name}@{manifest.version}, "
                              f"not {spec.name}@{spec.version}", "manifest.name")  # fmt: skip


def open_local_folder(folder: Path, trusted_keys: dict[str, bytes] | None, info: EngineInfo) -> LocalPull:
    """A local adapter folder, verified as far as the configuration demands (see the module doc)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise E.ArtifactError(E.MISSING_FILE, f"{folder} is not a folder", "adapter")
    started = time.perf_counter()
    signed = (folder / MANIFEST_FILE).is_file() and (folder / SIGNATURE_FILE).is_file()
    if trusted_keys:
        if not signed:
            raise E.ArtifactError(E.UNSIGNED, "trusted keys are configured, so every adapter must be signed "
                                  "(loraplane adapter pack, then sign)", str(folder))  # fmt: skip
        verified = verify_folder(folder, trusted_keys=trusted_keys, policy=policy_for(info))
        return LocalPull(
            folder, verified.digest, verified.manifest.version, 0.0, time.perf_counter() - started
        )
    check_shapes(folder, info)
    if signed:
        version = json.loads((folder / MANIFEST_FILE).read_bytes()).get("version", "local")
        digest = "sha256:" + hashlib.sha256((folder / MANIFEST_FILE).read_bytes()).hexdigest()
        log.warning("no trusted keys configured: the signature of %s is not checked", folder)
    else:
        version, digest = "local", "sha256:" + _sha256(folder / WEIGHTS_FILE)
        log.warning(
            "no trusted keys configured: serving the UNSIGNED adapter %s (shapes checked only)", folder
        )
    return LocalPull(folder, digest, str(version), 0.0, time.perf_counter() - started)


def check_shapes(folder: Path, info: EngineInfo) -> None:
    """Modules, ranks and a finite header of an unsigned folder, against what the engine serves."""
    from loraplane.artifacts.peft import inspect_weights

    weights = inspect_weights(folder / WEIGHTS_FILE, allowed_modules=frozenset(info.target_modules))
    too_high = {m: r for m, r in weights.ranks.items() if r > info.max_lora_rank}
    if too_high:
        raise E.ArtifactError(E.RANK_TOO_HIGH, f"ranks {too_high} exceed {info.max_lora_rank}", WEIGHTS_FILE)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
