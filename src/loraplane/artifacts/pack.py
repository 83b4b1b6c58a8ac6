"""The producer side: pack a PEFT folder into a manifest, sign it, push it to S3.

``pack`` refuses what the engine would refuse later (pickle weights, unknown modules, shapes that do not
fit the base, ranks above the limit), so a bad adapter fails on the producer's machine, not on a pod.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from loraplane.artifacts import errors as E
from loraplane.artifacts import s3 as S3
from loraplane.artifacts.base_hash import BaseHashError, compute_base_hash
from loraplane.artifacts.fsutil import file_identity, settled
from loraplane.artifacts.manifest import (
    CONFIG_FILE,
    MANIFEST_FILE,
    OPTIONAL_FILES,
    REQUIRED_FILES,
    SIGNATURE_FILE,
    WEIGHTS_FILE,
    FileEntry,
    Manifest,
    check_file_name,
    digest_of,
    normalize_base_hash,
)
from loraplane.artifacts.peft import (
    DEFAULT_MAX_RANK,
    check_against_base,
    check_rank,
    inspect_weights,
    module_scaling,
)
from loraplane.artifacts.peft_config import read_adapter_config
from loraplane.artifacts.s3blobs import push_blobs
from loraplane.artifacts.signing import parse_signature, sign_bytes
from loraplane.artifacts.verify import (
    check_listing,
    folder_listing,
    hash_file,
)

# A producer that packs many artifacts sharing files (hard links, one weights file per rank) hashes and checks
# each file once per process when it packs: a file that kept its identity since then, and has settled, holds
# the same bytes (fsutil.settled). identity -> (file name, sha256); the name too, since the weights file is
# also checked. Signing hashes every file again.
_PACKED: dict[tuple, tuple[str, str]] = {}
_PACKED_MAX = 4096


def packed_digest(path: Path, name: str, expected: str | None = None) -> str:
    """``hash_file(path, name, expected)``, from the process's earlier hash of the same unchanged file when it
    has one. Only a hash whose content was judged (no ``expected``, or equal to it) is remembered."""
    before = file_identity(path)
    known = _PACKED.get(before)
    if known is not None and known[0] == name and settled(path, before):
        return known[1]
    digest = hash_file(path, name, expected)
    if expected in (None, digest) and settled(path, before):
        if len(_PACKED) >= _PACKED_MAX:
            _PACKED.clear()
        _PACKED[before] = (name, digest)
    return digest


def _producer() -> str:
    try:
        from loraplane import __version__
    except ImportError:  # pragma: no cover
        __version__ = "dev"
    return f"loraplane {__version__}"


def check_folder_files(folder: Path) -> list[str]:
    """The adapter's payload files; refuses pickle, nested, odd and unexpected entries."""
    names = []
    for name, size in folder_listing(folder).items():
        if name in (MANIFEST_FILE, SIGNATURE_FILE):
            continue
        check_file_name(name, name)
        if size < 0:
            raise E.ArtifactError(E.UNEXPECTED_FILE, "only regular files belong in an adapter folder", name)
        if name not in REQUIRED_FILES | OPTIONAL_FILES:
            raise E.ArtifactError(
                E.UNEXPECTED_FILE, f"not part of an adapter ({sorted(REQUIRED_FILES)})", name
            )
        names.append(name)
    for name in sorted(REQUIRED_FILES - set(names)):
        raise E.ArtifactError(E.MISSING_FILE, "a PEFT LoRA folder needs it", name)
    return names


def pack_folder(
    folder: str | Path,
    *,
    name: str,
    version: str,
    base_dir: str | Path | None = None,
    base_hash: str | None = None,
    max_rank: int | None = DEFAULT_MAX_RANK,
    created: str | None = None,
) -> Manifest:
    """Check the PEFT folder (against the base when given) and write its unsigned manifest."""
    folder = Path(folder)
    if (base_dir is None) == (base_hash is None):
        raise ValueError("give exactly one of base_dir and base_hash")
    names = check_folder_files(folder)
    config = read_adapter_config(folder / CONFIG_FILE)
    weights = inspect_weights(folder / WEIGHTS_FILE)
    check_rank(weights.ranks, max_rank, WEIGHTS_FILE)
    scaling = module_scaling(config, weights)  # the config's r and patterns must fit the weights
    if base_dir is not None:
        base_config_path = Path(base_dir) / "config.json"
        try:
            base_config = json.loads(base_config_path.read_text())
            base_hash = compute_base_hash(base_dir)
        except (OSError, json.JSONDecodeError, BaseHashError) as exc:
            raise E.ArtifactError(E.BAD_MANIFEST, f"unusable base folder ({exc})", "base") from None
        check_against_base(folder / WEIGHTS_FILE, base_config)
    files = {n: FileEntry(packed_digest(folder / n, n), (folder / n).stat().st_size) for n in names}
    manifest = Manifest(
        name=name,
        version=version,
        base_model_hash=normalize_base_hash(base_hash, "base_hash"),
        ranks=weights.ranks,
        alpha=config.alpha,
        alphas=scaling.alphas,
        scales=scaling.scales,
        target_modules=tuple(weights.ranks),
        dtype=weights.dtype,
        files=files,
        created=created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        producer=_producer(),
        use_rslora=config.use_rslora,
    )
    (folder / SIGNATURE_FILE).unlink(missing_ok=True)  # a new manifest voids an old signature
    (folder / MANIFEST_FILE).write_bytes(manifest.canonical_bytes())
    return manifest


def _check_packed(folder: Path) -> tuple[bytes, Manifest]:
    """The folder still holds exactly the bytes its manifest lists."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise E.ArtifactError(E.MISSING_FILE, "run `loraplane adapter pack` first", MANIFEST_FILE)
    manifest_bytes = path.read_bytes()
    manifest = Manifest.from_json(manifest_bytes)
    listing = {k: v for k, v in folder_listing(folder).items() if k != SIGNATURE_FILE}
    check_listing(manifest, listing, "")
    for fname, entry in manifest.files.items():
        # Every byte again, no memo: signing is the gate, and a file's identity does not catch every
        # write (writes through a shared mapping, network file systems' cached attributes).
        if hash_file(folder / fname, fname, entry.sha256) != entry.sha256:
            raise E.ArtifactError(E.FILE_HASH_MISMATCH, "changed since pack; pack again", fname)
    return manifest_bytes, manifest


def sign_folder(folder: str | Path, private_pem: bytes) -> dict:
    """Write loraplane-manifest.sig after re-checking the files against the manifest."""
    folder = Path(folder)
    manifest_bytes, manifest = _check_packed(folder)
    sig = sign_bytes(manifest_bytes, private_pem)
    (folder / SIGNATURE_FILE).write_bytes(sig)
    return {
        "digest": digest_of(manifest_bytes),
        "key_id": parse_signature(sig)["key_id"],
        "name": manifest.name,
    }


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class Progress:
    """A byte counter drawn on stderr (boto3 calls it from its transfer threads)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None):
        self.total, self.label, self.done = max(total, 1), label, 0
        self.stream = stream or sys.stderr
        self._lock, self._shown = threading.Lock(), -1

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            pct = min(100, self.done * 100 // self.total)
            step = 1 if self.stream.isatty() else 25
            if pct // step == self._shown // step and pct != 100 or pct == self._shown:
                return
            self._shown = pct
            bar = "#" * (pct // 5) + "." * (20 - pct // 5)
            end = "\n" if pct == 100 or not self.stream.isatty() else ""
            self.stream.write(
                f"\r{self.label} [{bar}] {pct:3d}% {_human(self.done)}/{_human(self.total)}{end}"
            )
            self.stream.flush()


def push_folder(
    folder: str | Path,
    uri: str,
    *,
    s3_client,
    force: bool = False,
    chunk_bytes: int = 8 << 20,
    progress: Callable[[int], None] | None = None,
    retry: S3.RetryPolicy | None = None,
) -> dict:
    """Upload a signed folder: each file to its content-addressed blob (s3blobs.py; skipped when the bucket
    holds it already), then the manifest, then the signature under the prefix (readers never see a signed
    manifest whose files are not there yet). Versions are immutable: a different manifest under the same
    prefix is refused unless ``force``, which replaces it and uploads every blob again. Files of a version
    pushed before blobs existed are removed from the prefix once their blobs are stored."""
    from boto3.s3.transfer import TransferConfig

    folder = Path(folder)
    manifest_bytes, manifest = _check_packed(folder)
    if not (folder / SIGNATURE_FILE).is_file():
        raise E.ArtifactError(E.UNSIGNED, "run `loraplane adapter sign` first", SIGNATURE_FILE)
    parse_signature((folder / SIGNATURE_FILE).read_bytes())
    bucket, prefix = S3.parse_s3_uri(uri)
    retry = retry or S3.RetryPolicy()
    existing = S3.list_prefix(s3_client, bucket, prefix, retry=retry)
    if existing:
        remote = S3.get_small(s3_client, bucket, prefix + MANIFEST_FILE, max_bytes=1 << 20, retry=retry)
        if remote != manifest_bytes and not force:
            raise E.ArtifactError(
                E.VERSION_EXISTS,
                f"s3://{bucket}/{prefix} already holds another version (use --force)",
                "source.uri",
            )
    config = TransferConfig(
        multipart_threshold=chunk_bytes, multipart_chunksize=chunk_bytes, max_concurrency=4
    )

    def upload(path: Path, key: str) -> None:
        S3.with_retries(
            lambda: s3_client.upload_file(str(path), bucket, key, Config=config, Callback=progress),
            what=f"s3://{bucket}/{key}",
            retry=retry,
        )

    sent = push_blobs(s3_client, bucket, folder, manifest, upload=upload, force=force, retry=retry,
                      progress=progress)  # fmt: skip
    for key in [prefix + k for k in existing if k not in (MANIFEST_FILE, SIGNATURE_FILE)]:
        S3.with_retries(
            lambda key=key: s3_client.delete_object(Bucket=bucket, Key=key), what=key, retry=retry
        )
    for fname in (MANIFEST_FILE, SIGNATURE_FILE):
        upload(folder / fname, prefix + fname)
    return {
        "uri": f"s3://{bucket}/{prefix}",
        "digest": digest_of(manifest_bytes),
        "bytes": manifest.total_bytes,
        **sent,
    }
