"""The adapter supply chain: torch-free (manifests, signatures, base hash, S3 host cache, CLI).

The public names below are importable from here; they load lazily, so ``import
loraplane.artifacts.base_hash`` (the engine) does not pull in boto3 or cryptography.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ArtifactError": "errors",
    "Manifest": "manifest",
    "FileEntry": "manifest",
    "generate_keypair": "signing",
    "key_id": "signing",
    "sign_manifest": "signing",
    "verify_signature": "signing",
    "load_trusted_keys": "signing",
    "parse_s3_uri": "s3",
    "make_client": "s3",
    "RetryPolicy": "s3",
    "Policy": "verify",
    "VerifiedManifest": "verify",
    "fetch_verified_manifest": "verify",
    "verify_folder": "verify",
    "HostCache": "cache",
    "LocalAdapter": "cache",
    "compute_base_hash": "base_hash",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
