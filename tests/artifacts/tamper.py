"""Helpers to store hand-made (tampered) artifacts in S3 and to check that a cache holds nothing unverified."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from loraplane.artifacts.manifest import MANIFEST_FILE, SIGNATURE_FILE, canonical_json
from loraplane.artifacts.signing import sign_bytes
from loraplane.artifacts.verify import Policy, verify_folder


def upload_folder(s3, bucket: str, prefix: str, folder: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}
    for name, data in files.items():
        s3.put_object(Bucket=bucket, Key=prefix + name, Body=data)
    return files


def resign(s3, bucket: str, prefix: str, manifest: dict | bytes, private_pem: bytes) -> bytes:
    """Store a (possibly malformed) manifest and a valid signature over its exact bytes."""
    raw = manifest if isinstance(manifest, bytes) else canonical_json(manifest)
    s3.put_object(Bucket=bucket, Key=prefix + MANIFEST_FILE, Body=raw)
    s3.put_object(Bucket=bucket, Key=prefix + SIGNATURE_FILE, Body=sign_bytes(raw, private_pem))
    return raw


def manifest_dict(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST_FILE).read_bytes())


def assert_cache_holds_only_verified(root: Path, trusted_keys: dict) -> None:
    """Every adapter folder verifies completely, every blob's content matches its name, no partial files."""
    root = Path(root)
    for folder in (root / "adapters").iterdir():
        assert not folder.name.startswith("."), f"hidden entry {folder} in adapters/"
        verify_folder(folder, trusted_keys=trusted_keys, policy=Policy())
    for blob in (root / "blobs").iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name, (
            f"blob {blob.name} is not its content"
        )
    leftovers = [e for e in os.listdir(root / "tmp")]
    assert not leftovers, f"tmp/ holds {leftovers}"


def pull_from(cache, uri, keys, base_hash, **kw):
    """``cache.pull`` with the tests' trusted keys and base hash."""
    return cache.pull(uri, trusted_keys=keys.trusted, expected_base_hash=base_hash, **kw)
