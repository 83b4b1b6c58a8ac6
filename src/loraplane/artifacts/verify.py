"""Verification: signature, pinned digest, base hash, policy (rank, modules, sizes), the file list, and
that the signed files say what the signed manifest says.

``fetch_verified_manifest`` reads only the manifest, its signature, the object listing and the size of each
file's blob from S3 (never the weights): what the operator needs before it lets an adapter near a pod. ``verify_folder`` checks a
local folder completely, hashing every file. The host cache (cache.py) hashes while it streams. Whoever
holds the files (``verify_folder``, the host cache, ``loraplane adapter verify s3://...``) then compares
them with the manifest through ``check_contents``: a producer's mistake (or a careless signer) must not
turn into weights that differ from what the signature vouches for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.artifacts import s3 as S3
from loraplane.artifacts.manifest import (
    CONFIG_FILE,
    KNOWN_MODULES,
    MANIFEST_FILE,
    OPTIONAL_FILES,
    REQUIRED_FILES,
    SIGNATURE_FILE,
    WEIGHTS_FILE,
    Manifest,
    check_file_name,
    digest_of,
    normalize_base_hash,
    normalize_digest,
)
from loraplane.artifacts.peft import check_rank, module_scaling, weights_of
from loraplane.artifacts.peft_config import lora_scale, parse_adapter_config
from loraplane.artifacts.s3blobs import Located, locate_files
from loraplane.artifacts.signing import verify_signature
from loraplane.artifacts.tensors import TensorScanner, TensorSpan, hash_and_check, read_layout

DEFAULT_MAX_FILE_BYTES = 4 << 30  # 4 GiB: far above any LoRA of a served base
MAX_MANIFEST_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Policy:
    """What a consumer accepts besides a valid signature. None disables a check."""

    expected_base_hash: str | None = None
    pinned_digest: str | None = None
    max_rank: int | None = None
    allowed_modules: frozenset[str] | None = None  # None: the modules the engine serves (KNOWN_MODULES)
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES

    def __post_init__(self):
        if self.expected_base_hash is not None:
            object.__setattr__(
                self, "expected_base_hash", normalize_base_hash(self.expected_base_hash, "base_hash")
            )
        if self.pinned_digest is not None:
            object.__setattr__(
                self, "pinned_digest", normalize_digest(self.pinned_digest, "source.manifestDigest")
            )
        modules = KNOWN_MODULES if self.allowed_modules is None else self.allowed_modules
        object.__setattr__(self, "allowed_modules", frozenset(modules))
        if self.max_rank is not None and self.max_rank < 1:
            raise ValueError("Policy.max_rank must be >= 1")


@dataclass(frozen=True, slots=True)
class VerifiedManifest:
    manifest: Manifest
    digest: str  # "sha256:<hex>" of the manifest bytes: the adapter version's identity
    key_id: str  # who signed it
    manifest_bytes: bytes
    signature_bytes: bytes
    uri: str | None = None
    locations: Mapping[str, Located] | None = None  # S3 only: file name -> the object holding its bytes


def verify_manifest_bytes(
    manifest_bytes: bytes | None,
    sig_bytes: bytes | None,
    *,
    trusted_keys: Mapping[str, bytes],
    policy: Policy,
    uri: str | None = None,
) -> VerifiedManifest:
    """Signature first (nothing of an unsigned manifest is trusted), then identity, base and policy."""
    if manifest_bytes is None:
        raise E.ArtifactError(E.MISSING_FILE, "no loraplane-manifest.json", MANIFEST_FILE)
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise E.ArtifactError(E.FILE_TOO_LARGE, f"manifest above {MAX_MANIFEST_BYTES} bytes", MANIFEST_FILE)
    key = verify_signature(manifest_bytes, sig_bytes, trusted_keys)
    digest = digest_of(manifest_bytes)
    if policy.pinned_digest is not None and digest != policy.pinned_digest:
        raise E.ArtifactError(
            E.DIGEST_MISMATCH,
            f"manifest digest {digest} differs from the pinned {policy.pinned_digest}",
            "manifest.digest",
        )
    manifest = Manifest.from_json(manifest_bytes)
    check_policy(manifest, policy)
    return VerifiedManifest(manifest, digest, key, manifest_bytes, sig_bytes, uri)


def check_policy(manifest: Manifest, policy: Policy) -> None:
    base = policy.expected_base_hash
    if base is not None and manifest.base_model_hash != base:
        raise E.ArtifactError(
            E.BASE_MISMATCH,
            f"trained for base {manifest.base_model_hash[:16]}..., this base is {base[:16]}...",
            "manifest.base_model_hash",
        )
    check_rank(dict(manifest.ranks), policy.max_rank)
    unknown = sorted(set(manifest.target_modules) - policy.allowed_modules)
    if unknown:
        raise E.ArtifactError(
            E.UNKNOWN_MODULE, f"modules {unknown} are not served", "manifest.target_modules"
        )
    for name, entry in manifest.files.items():
        if name not in REQUIRED_FILES | OPTIONAL_FILES:
            raise E.ArtifactError(
                E.UNEXPECTED_FILE, f"{name!r} is not part of an adapter artifact", f"manifest.files.{name}"
            )
        if entry.size > policy.max_file_bytes:
            raise E.ArtifactError(
                E.FILE_TOO_LARGE,
                f"{entry.size} bytes > limit {policy.max_file_bytes}",
                f"manifest.files.{name}",
            )


def check_listing(manifest: Manifest, present: Mapping[str, int], where: str) -> None:
    """The stored files are exactly the manifest's files (+ manifest and signature), with the listed sizes."""
    check_unexpected(manifest, present, where)
    for name, entry in manifest.files.items():
        if name not in present:
            raise E.ArtifactError(E.MISSING_FILE, "listed in the manifest but absent", name)
        if present[name] != entry.size:
            raise E.ArtifactError(
                E.FILE_SIZE_MISMATCH, f"{present[name]} bytes, manifest says {entry.size}", name
            )


def check_unexpected(manifest: Manifest, present: Mapping[str, int], where: str) -> None:
    """Nothing is stored beside the manifest's files, the manifest and its signature."""
    for name in sorted(present):
        if name in (MANIFEST_FILE, SIGNATURE_FILE) or name in manifest.files:
            continue
        check_file_name(name, f"{where}{name}")  # BadPath / PickleWeights say more than "unexpected"
        raise E.ArtifactError(E.UNEXPECTED_FILE, f"{name!r} is not listed in the manifest", f"{where}{name}")


def fetch_verified_manifest(
    uri: str,
    *,
    trusted_keys: Mapping[str, bytes],
    expected_base_hash: str | None,
    pinned_digest: str | None = None,
    max_rank: int | None = None,
    allowed_modules: set[str] | frozenset[str] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    s3_client=None,
    retry: S3.RetryPolicy | None = None,
) -> VerifiedManifest:
    """Verify an S3 adapter version without downloading its weights. Raises ArtifactError."""
    bucket, prefix = S3.parse_s3_uri(uri)
    policy = Policy(expected_base_hash, pinned_digest, max_rank, allowed_modules, max_file_bytes)
    client = s3_client or S3.make_client()
    retry = retry or S3.RetryPolicy()
    present = S3.list_prefix(client, bucket, prefix, retry=retry)
    if not present:
        raise E.ArtifactError(E.NOT_FOUND, f"nothing stored under s3://{bucket}/{prefix}", "source.uri")
    manifest_bytes = sig_bytes = None
    if MANIFEST_FILE in present:
        manifest_bytes = S3.get_small(
            client, bucket, prefix + MANIFEST_FILE, max_bytes=MAX_MANIFEST_BYTES, retry=retry
        )
    if SIGNATURE_FILE in present:
        sig_bytes = S3.get_small(client, bucket, prefix + SIGNATURE_FILE, max_bytes=4096, retry=retry)
    verified = verify_manifest_bytes(
        manifest_bytes, sig_bytes, trusted_keys=trusted_keys, policy=policy, uri=f"s3://{bucket}/{prefix}"
    )
    check_unexpected(verified.manifest, present, "")
    located = locate_files(client, bucket, prefix, verified.manifest, present, retry=retry)
    check_listing(verified.manifest, {**present, **{n: f.size for n, f in located.items()}}, "")
    return dataclasses.replace(verified, locations=located)


def verify_remote_files(client, verified: VerifiedManifest, policy: Policy, retry: S3.RetryPolicy) -> None:
    """Stream every file of a manifest from fetch_verified_manifest once through sha256 (the weights through
    the tensor checks too), storing none but the small config, then compare the files with the manifest."""
    bucket, _ = S3.parse_s3_uri(verified.uri)
    manifest = verified.manifest
    config, discard, scanners = _Sink(keep=True), _Sink(keep=False), []

    def new_scanner() -> TensorScanner:
        scanners.append(TensorScanner(manifest.files[WEIGHTS_FILE].size, WEIGHTS_FILE))
        return scanners[-1]

    for name, entry in manifest.files.items():
        S3.stream_verified(client, bucket, verified.locations[name].key, sha256=entry.sha256, size=entry.size,
                           open_sink=(lambda: config) if name == CONFIG_FILE else (lambda: discard), retry=retry,
                           new_check=new_scanner if name == WEIGHTS_FILE else None, name=name)  # fmt: skip
    check_contents(manifest, scanners[-1].spans, bytes(config.data), policy)


class _Sink:
    """Where a streamed file goes: kept in memory (the config) or dropped; each attempt starts empty."""

    def __init__(self, keep: bool) -> None:
        self.keep, self.data = keep, bytearray()

    def write(self, data: bytes) -> int:
        if self.keep:
            self.data += data
        return len(data)

    def __enter__(self) -> _Sink:
        self.data.clear()
        return self

    def __exit__(self, *_) -> None:
        return None


def hash_file(path: Path, name: str, expected: str | None = None) -> str:
    """sha256 of an artifact file; the weights are checked (layout, finite values) in the same read."""
    if name == WEIGHTS_FILE:
        return hash_and_check(path, name, expected)
    return sha256_file(path)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(S3.CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def folder_listing(folder: Path) -> dict[str, int]:
    """{name: size} of a folder's entries; subfolders and links count as (unexpected) entries."""
    listing = {}
    for entry in sorted(Path(folder).iterdir()):
        listing[entry.name] = entry.stat().st_size if entry.is_file() and not entry.is_symlink() else -1
    return listing


def verify_folder(
    folder: Path,
    *,
    trusted_keys: Mapping[str, bytes],
    policy: Policy,
    holds: Callable[[Path, str, str], bool] | None = None,
) -> VerifiedManifest:
    """Complete offline verification of a signed adapter folder, every file hashed. ``holds(path, name,
    sha256)``: whether a file holds the manifest's bytes, in place of hashing it (the host cache's
    ``check_file``, which skips files this process verified and nobody wrote since)."""
    folder = Path(folder)
    read = lambda name: (folder / name).read_bytes() if (folder / name).is_file() else None
    verified = verify_manifest_bytes(
        read(MANIFEST_FILE), read(SIGNATURE_FILE), trusted_keys=trusted_keys, policy=policy
    )
    check_listing(verified.manifest, folder_listing(folder), "")
    holds = holds or (lambda path, name, sha256: hash_file(path, name, sha256) == sha256)
    for name, entry in verified.manifest.files.items():
        if not holds(folder / name, name, entry.sha256):
            raise E.ArtifactError(E.FILE_HASH_MISMATCH, "sha256 differs from the manifest", name)
    check_folder_contents(folder, verified.manifest, policy)
    return verified


def check_folder_contents(folder: Path, manifest: Manifest, policy: Policy) -> None:
    """check_contents for a folder whose files already matched the manifest's hashes."""
    folder = Path(folder)
    spans = read_layout(folder / WEIGHTS_FILE, WEIGHTS_FILE)
    check_contents(manifest, spans, (folder / CONFIG_FILE).read_bytes(), policy)


def check_contents(manifest: Manifest, spans: list[TensorSpan], config_bytes: bytes, policy: Policy) -> None:
    """The one comparison of the files with their manifest: the weights' modules, ranks and dtype (their
    safetensors header, ``spans``) and the config's scaling must be exactly the manifest's."""
    weights = weights_of(spans, allowed_modules=policy.allowed_modules)
    if set(weights.ranks) != set(manifest.target_modules):
        raise E.ArtifactError(E.UNKNOWN_MODULE, f"the weights hold {sorted(weights.ranks)}, the manifest says "
                              f"{list(manifest.target_modules)}", WEIGHTS_FILE)  # fmt: skip
    for module, rank in weights.ranks.items():
        if rank != manifest.ranks[module]:
            reason = E.RANK_TOO_HIGH if rank > manifest.ranks[module] else E.RANK_MISMATCH
            raise E.ArtifactError(reason, f"{module} has rank {rank}, the manifest says {manifest.ranks[module]}",
                                  WEIGHTS_FILE)  # fmt: skip
    if weights.dtype != manifest.dtype:
        raise E.ArtifactError(
            E.BAD_MANIFEST,
            f"the weights are {weights.dtype}, the manifest says {manifest.dtype}",
            WEIGHTS_FILE,
        )
    try:
        config = parse_adapter_config(json.loads(config_bytes))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise E.ArtifactError(E.BAD_MANIFEST, f"unreadable ({type(exc).__name__})", CONFIG_FILE) from None
    _check_scaling(manifest, config, module_scaling(config, weights))


def _check_scaling(manifest: Manifest, config, scaling) -> None:
    """The config computes the alphas and scales the manifest records (pack wrote them from it)."""
    alphas = (
        dict(manifest.alphas) if manifest.alphas is not None else {m: manifest.alpha for m in scaling.ranks}
    )
    scales = dict(manifest.scales) if manifest.scales is not None else {
        m: lora_scale(alphas[m], r, manifest.use_rslora) for m, r in scaling.ranks.items()
    }  # fmt: skip
    recorded = {"use_rslora": manifest.use_rslora, "alpha": manifest.alpha, **{f"alphas.{m}": a for m, a in alphas.items()},
                **{f"scales.{m}": v for m, v in scales.items()}}  # fmt: skip
    computed = {"use_rslora": config.use_rslora, "alpha": config.alpha,
                **{f"alphas.{m}": a for m, a in scaling.alphas.items()},
                **{f"scales.{m}": v for m, v in scaling.scales.items()}}  # fmt: skip
    for key in sorted(recorded.keys() | computed.keys()):
        mine, theirs = recorded.get(key), computed.get(key)
        if mine is None or theirs is None or not math.isclose(mine, theirs, rel_tol=1e-9):
            raise E.ArtifactError(
                E.BAD_MANIFEST, f"manifest.{key} is {mine}, {CONFIG_FILE} gives {theirs}", CONFIG_FILE
            )
