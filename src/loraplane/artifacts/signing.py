"""Ed25519 signatures over the canonical manifest bytes (through ``cryptography``; no hand-made crypto).

The ``.sig`` file is canonical JSON::

    {"alg": "ed25519", "key_id": "<16 hex>", "manifest_digest": "sha256:<hex>", "signature": "<base64>"}

``key_id`` is the first 16 hex digits of sha256(raw 32-byte public key): a name for the key derived from
the key itself, so a trusted-key folder needs no naming convention. The signature covers the exact manifest
bytes; ``manifest_digest`` only lets a reader report a mismatch early and readably.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from loraplane.artifacts import errors as E
from loraplane.artifacts.manifest import Manifest, canonical_json, digest_of

ALGORITHM = "ed25519"
MAX_SIG_BYTES = 4096


def generate_keypair() -> tuple[bytes, bytes]:
    """(private key PEM, unencrypted PKCS#8; public key PEM, SubjectPublicKeyInfo)."""
    private = Ed25519PrivateKey.generate()
    private_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem


def _load_public(public_pem: bytes | str, field_: str) -> Ed25519PublicKey:
    data = public_pem.encode() if isinstance(public_pem, str) else public_pem
    if b"PRIVATE KEY-----" in data:  # a private key where public ones belong: say so, never parse it
        raise E.ArtifactError(E.BAD_KEY, "holds a private key; trusted keys must be public keys", field_)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise E.ArtifactError(E.BAD_KEY, f"not a PEM public key ({exc})", field_) from None
    if not isinstance(key, Ed25519PublicKey):
        raise E.ArtifactError(E.BAD_KEY, f"{type(key).__name__} is not an ed25519 key", field_)
    return key


def _load_private(private_pem: bytes | str) -> Ed25519PrivateKey:
    data = private_pem.encode() if isinstance(private_pem, str) else private_pem
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        # never echo the key material
        raise E.ArtifactError(
            E.BAD_KEY, f"not an unencrypted PEM private key ({type(exc).__name__})", "key"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise E.ArtifactError(E.BAD_KEY, f"{type(key).__name__} is not an ed25519 key", "key")
    return key


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_pem: bytes | str) -> str:
    return hashlib.sha256(_raw_public(_load_public(public_pem, "key"))).hexdigest()[:16]


def sign_bytes(manifest_bytes: bytes, private_pem: bytes | str) -> bytes:
    """Sign exact manifest bytes (use sign_manifest unless you are building a test artifact)."""
    private = _load_private(private_pem)
    return canonical_json(
        {
            "alg": ALGORITHM,
            "key_id": hashlib.sha256(_raw_public(private.public_key())).hexdigest()[:16],
            "manifest_digest": digest_of(manifest_bytes),
            "signature": base64.b64encode(private.sign(manifest_bytes)).decode(),
        }
    )


def sign_manifest(manifest: Manifest, private_pem: bytes | str) -> bytes:
    """The content of loraplane-manifest.sig for ``manifest.canonical_bytes()``."""
    return sign_bytes(manifest.canonical_bytes(), private_pem)


def parse_signature(sig_bytes: bytes) -> dict:
    field_ = "loraplane-manifest.sig"
    if len(sig_bytes) > MAX_SIG_BYTES:
        raise E.ArtifactError(E.BAD_SIGNATURE, f"{len(sig_bytes)} bytes is too large for a signature", field_)
    try:
        sig = json.loads(sig_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise E.ArtifactError(E.BAD_SIGNATURE, "not a JSON signature file", field_) from None
    if not isinstance(sig, dict) or set(sig) != {"alg", "key_id", "manifest_digest", "signature"}:
        raise E.ArtifactError(
            E.BAD_SIGNATURE, "expected fields alg, key_id, manifest_digest, signature", field_
        )
    if sig["alg"] != ALGORITHM:
        raise E.ArtifactError(E.BAD_SIGNATURE, f"unsupported algorithm {sig['alg']!r}", f"{field_}.alg")
    if not all(isinstance(sig[k], str) for k in sig):
        raise E.ArtifactError(E.BAD_SIGNATURE, "all fields must be strings", field_)
    try:
        sig["signature"] = base64.b64decode(sig["signature"], validate=True)
    except (binascii.Error, ValueError):
        raise E.ArtifactError(E.BAD_SIGNATURE, "signature is not base64", f"{field_}.signature") from None
    return sig


def verify_signature(
    manifest_bytes: bytes, sig_bytes: bytes | None, trusted_keys: Mapping[str, bytes]
) -> str:
    """Return the signing key id, or raise Unsigned / UnknownKey / BadSignature."""
    if sig_bytes is None:
        raise E.ArtifactError(
            E.UNSIGNED, "no loraplane-manifest.sig next to the manifest", "loraplane-manifest.sig"
        )
    sig = parse_signature(sig_bytes)
    kid = sig["key_id"]
    if kid not in trusted_keys:
        raise E.ArtifactError(
            E.UNKNOWN_KEY,
            f"signed by key {kid!r}, not one of the {len(trusted_keys)} trusted key(s)",
            "key_id",
        )
    public = _load_public(trusted_keys[kid], f"trusted_keys.{kid}")
    if hashlib.sha256(_raw_public(public)).hexdigest()[:16] != kid:
        raise E.ArtifactError(
            E.BAD_KEY, f"trusted key stored under id {kid!r} has another id", "trusted_keys"
        )
    if sig["manifest_digest"] != digest_of(manifest_bytes):
        raise E.ArtifactError(
            E.BAD_SIGNATURE,
            "the signature was made for another manifest (digest differs)",
            "loraplane-manifest.sig",
        )
    try:
        public.verify(sig["signature"], manifest_bytes)
    except InvalidSignature:
        raise E.ArtifactError(
            E.BAD_SIGNATURE, f"signature by key {kid!r} does not verify", "loraplane-manifest.sig"
        ) from None
    return kid


def load_trusted_keys(source: str | Path | Mapping[str, bytes | str]) -> dict[str, bytes]:
    """Trusted public keys as {key_id: PEM}.

    ``source`` is a folder (e.g. a mounted Secret or ConfigMap: every regular, non-hidden file holds one
    PEM public key; Kubernetes' ``..data`` links are skipped) or a mapping name -> PEM (e.g. Secret data,
    already base64-decoded). Key ids are derived from the keys; an entry named like a key id (16 hex digits,
    optionally .pub/.pem) must hold that key.
    """
    if isinstance(source, Mapping):
        items = [(str(name), value) for name, value in source.items()]
    else:
        folder = Path(source)
        if not folder.is_dir():
            raise E.ArtifactError(E.BAD_KEY, f"{folder} is not a folder of public keys", "trusted_keys")
        items = [
            (p.name, p.read_bytes())
            for p in sorted(folder.iterdir())
            if not p.name.startswith(".") and p.is_file()
        ]
    keys: dict[str, bytes] = {}
    for name, value in items:
        pem = value.encode() if isinstance(value, str) else bytes(value)
        kid = key_id_checked(pem, f"trusted_keys.{name}")
        stem = name.rsplit(".", 1)[0] if name.endswith((".pub", ".pem")) else name
        if re.fullmatch(r"[0-9a-f]{16}", stem) and stem != kid:  # named by a key id, but another one
            raise E.ArtifactError(
                E.BAD_KEY, f"entry is named {stem!r} but holds key {kid!r}", f"trusted_keys.{name}"
            )
        keys[kid] = pem
    if not keys:
        raise E.ArtifactError(E.BAD_KEY, "no trusted public keys found", "trusted_keys")
    return keys


def key_id_checked(public_pem: bytes, field_: str) -> str:
    return hashlib.sha256(_raw_public(_load_public(public_pem, field_))).hexdigest()[:16]
