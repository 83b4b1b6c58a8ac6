"""Unit tests: strict manifests, signatures and trusted keys, S3 URIs. No server needed."""

from __future__ import annotations

import json
import pickle

import pytest

from loraplane.artifacts import errors as E
from loraplane.artifacts.manifest import Manifest, canonical_json
from loraplane.artifacts.s3 import parse_s3_uri
from loraplane.artifacts.signing import (
    generate_keypair,
    key_id,
    load_trusted_keys,
    sign_bytes,
    sign_manifest,
    verify_signature,
)

GOOD = {
    "schema": "loraplane.dev/adapter-manifest/v1",
    "name": "support-bot",
    "version": "2026-11-30.1",
    "base_model_hash": "a" * 64,
    "ranks": {"q_proj": 8, "v_proj": 16},
    "alpha": 16,
    "use_rslora": False,
    "target_modules": ["v_proj", "q_proj"],
    "dtype": "bfloat16",
    "files": {
        "adapter_config.json": {"sha256": "b" * 64, "size": 700},
        "adapter_model.safetensors": {"sha256": "c" * 64, "size": 123456},
    },
    "created": "2026-11-30T06:40:00Z",
    "producer": "loraplane 0.1.0",
}


def test_manifest_is_canonical_and_digest_is_stable():
    m = Manifest.from_dict(GOOD)
    assert m.max_rank == 16 and m.target_modules == ("q_proj", "v_proj")
    raw = m.canonical_bytes()
    assert raw == canonical_json(json.loads(raw)) and b": " not in raw and b", " not in raw
    assert Manifest.from_json(raw) == m
    assert pickle.loads(pickle.dumps(m)) == m
    assert m.digest().startswith("sha256:") and len(m.digest()) == 71
    assert m.digest() == Manifest.from_dict(dict(reversed(list(GOOD.items())))).digest()


@pytest.mark.parametrize(
    "change,reason,field",
    [
        ({"name": "Bad_Name"}, E.BAD_MANIFEST, "manifest.name"),
        ({"version": "../v1"}, E.BAD_MANIFEST, "manifest.version"),
        ({"base_model_hash": "xyz"}, E.BAD_MANIFEST, "manifest.base_model_hash"),
        ({"ranks": {"q_proj": 0}}, E.BAD_MANIFEST, "manifest.ranks.q_proj"),
        ({"ranks": {"q_proj": 8}}, E.BAD_MANIFEST, "manifest.target_modules"),
        ({"alpha": -1}, E.BAD_MANIFEST, "manifest.alpha"),
        ({"dtype": "int8"}, E.BAD_MANIFEST, "manifest.dtype"),
        ({"created": "yesterday"}, E.BAD_MANIFEST, "manifest.created"),
        ({"surprise": 1}, E.BAD_MANIFEST, "manifest.surprise"),
        ({"files": {"adapter_config.json": {"sha256": "b" * 64, "size": 1}}}, E.MISSING_FILE, None),
        ({"files": {**GOOD["files"], "a/b.json": GOOD["files"]["adapter_config.json"]}}, E.BAD_PATH, None),
        ({"files": {**GOOD["files"], "..": GOOD["files"]["adapter_config.json"]}}, E.BAD_PATH, None),
        ({"files": {**GOOD["files"], "x" * 200: GOOD["files"]["adapter_config.json"]}}, E.BAD_PATH, None),
        (
            {"files": {**GOOD["files"], "model.pt": GOOD["files"]["adapter_config.json"]}},
            E.PICKLE_WEIGHTS,
            None,
        ),
        (
            {"files": {**GOOD["files"], "adapter_config.json": {"sha256": "B" * 64, "size": 1}}},
            E.BAD_MANIFEST,
            "manifest.files.adapter_config.json.sha256",
        ),
        (
            {"files": {**GOOD["files"], "adapter_config.json": {"sha256": "b" * 64, "size": -1}}},
            E.BAD_MANIFEST,
            "manifest.files.adapter_config.json.size",
        ),
    ],
)
def test_manifest_refuses_and_names_the_field(change, reason, field):
    with pytest.raises(E.ArtifactError) as err:
        Manifest.from_dict({**GOOD, **change})
    assert err.value.reason == reason
    if field:
        assert err.value.field == field


def test_missing_field_and_non_canonical_bytes():
    data = dict(GOOD)
    del data["dtype"]
    with pytest.raises(E.ArtifactError, match="manifest.dtype"):
        Manifest.from_dict(data)
    with pytest.raises(E.ArtifactError, match="not canonical") as err:
        Manifest.from_json(json.dumps(GOOD, indent=2).encode())
    assert err.value.reason == E.BAD_MANIFEST
    with pytest.raises(E.ArtifactError) as err:
        Manifest.from_json(b"\xff\xfe")
    assert err.value.reason == E.BAD_MANIFEST


def test_sign_and_verify():
    private, public = generate_keypair()
    m = Manifest.from_dict(GOOD)
    sig = sign_manifest(m, private)
    kid = key_id(public)
    assert json.loads(sig)["key_id"] == kid and len(kid) == 16
    assert verify_signature(m.canonical_bytes(), sig, {kid: public}) == kid
    with pytest.raises(E.ArtifactError) as err:
        verify_signature(m.canonical_bytes(), None, {kid: public})
    assert err.value.reason == E.UNSIGNED
    other_private, other_public = generate_keypair()
    with pytest.raises(E.ArtifactError) as err:
        verify_signature(m.canonical_bytes(), sign_bytes(m.canonical_bytes(), other_private), {kid: public})
    assert err.value.reason == E.UNKNOWN_KEY
    forged = json.loads(sig)
    forged["signature"] = json.loads(sign_bytes(m.canonical_bytes(), other_private))["signature"]
    with pytest.raises(E.ArtifactError) as err:  # right key id, wrong key's signature
        verify_signature(m.canonical_bytes(), canonical_json(forged), {kid: public})
    assert err.value.reason == E.BAD_SIGNATURE
    with pytest.raises(E.ArtifactError) as err:  # a key stored under someone else's id
        verify_signature(m.canonical_bytes(), sig, {kid: other_public})
    assert err.value.reason == E.BAD_KEY


def test_load_trusted_keys_from_secret_folder_and_mapping(tmp_path):
    _, pub1 = generate_keypair()
    _, pub2 = generate_keypair()
    data = tmp_path / "..2026_11_30"
    data.mkdir()
    (data / "team-a.pub").write_bytes(pub1)
    (data / "team-b.pem").write_bytes(pub2)
    (tmp_path / "..data").symlink_to(data.name)  # the layout of a mounted Secret
    (tmp_path / "team-a.pub").symlink_to("..data/team-a.pub")
    (tmp_path / "team-b.pem").symlink_to("..data/team-b.pem")
    keys = load_trusted_keys(tmp_path)
    assert keys == {key_id(pub1): pub1, key_id(pub2): pub2}
    assert load_trusted_keys({"a": pub1.decode()}) == {key_id(pub1): pub1}
    with pytest.raises(E.ArtifactError) as err:
        load_trusted_keys({"broken": b"-----BEGIN PUBLIC KEY-----\nnope\n"})
    assert err.value.reason == E.BAD_KEY and err.value.field == "trusted_keys.broken"
    with pytest.raises(E.ArtifactError):
        load_trusted_keys(tmp_path / "absent")
    assert load_trusted_keys({key_id(pub1): pub1}) == {key_id(pub1): pub1}  # a Secret keyed by key id
    with pytest.raises(E.ArtifactError) as err:
        load_trusted_keys({key_id(pub1): pub2})
    assert err.value.reason == E.BAD_KEY and "holds key" in err.value.message


def test_private_key_errors_do_not_echo_key_material():
    with pytest.raises(E.ArtifactError) as err:
        sign_bytes(b"{}", b"-----BEGIN PRIVATE KEY-----\nSECRETSECRET\n-----END PRIVATE KEY-----\n")
    assert err.value.reason == E.BAD_KEY and "SECRETSECRET" not in str(err.value)


@pytest.mark.parametrize(
    "uri,expected",
    [
        ("s3://adapters/support-bot/v1/", ("adapters", "support-bot/v1/")),
        ("s3://adapters/support-bot/v1", ("adapters", "support-bot/v1/")),
        ("s3://my.bucket-1/a/b/c/", ("my.bucket-1", "a/b/c/")),
    ],
)
def test_parse_s3_uri(uri, expected):
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize(
    "uri",
    [
        "https://adapters/x/",
        "s3://adapters",
        "s3://adapters/",
        "s3://Adapters/x/",
        "s3://adapters/../x/",
        "s3://adapters/a//b/",
        "s3://adapters/a/./b/",
        "s3://adapters/a b/",
        "s3://adapters/x/?versionId=1",
        "s3://ab/x/",
        "s3:///x/",
        None,
    ],
)
def test_parse_s3_uri_refuses(uri):
    with pytest.raises(E.ArtifactError) as err:
        parse_s3_uri(uri)
    assert err.value.reason == E.BAD_URI and err.value.field == "source.uri"


def test_error_reasons_are_documented_constants():
    assert {"Unsigned", "UnknownKey", "BadSignature", "DigestMismatch", "BaseMismatch", "FileHashMismatch",
            "FileSizeMismatch", "MissingFile", "UnexpectedFile", "BadPath", "PickleWeights", "RankTooHigh",
            "UnknownModule", "FileTooLarge", "BadManifest", "SourceUnreachable", "NotFound"} <= E.REASONS  # fmt: skip
    with pytest.raises(ValueError):
        E.ArtifactError("NoSuchReason", "x")


def test_artifacts_import_without_torch_or_engine():
    """The operator imports this package: it must stay torch-free (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import loraplane.artifacts.cli, loraplane.artifacts.cache, loraplane.artifacts.pack\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'triton', 'fastapi', 'numpy'}\n"
        "             or m.startswith(('loraplane.engine', 'loraplane.kernels', 'loraplane.operator')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/", timeout=60)
