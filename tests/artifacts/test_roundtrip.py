"""pack -> sign -> push -> verify -> pull against moto's standalone server."""

from __future__ import annotations

import pytest
from adapter_factory import build_signed_adapter, publish_adapter, push_adapter

from loraplane.artifacts import errors as E
from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.manifest import MANIFEST_FILE, Manifest
from loraplane.artifacts.verify import fetch_verified_manifest


def test_manifest_roundtrip_and_digest(tmp_path, keys, base_dir, base_hash):
    adapter = build_signed_adapter(
        tmp_path / "a", name="demo", version="v1", keys=keys, base_dir=base_dir, alpha=16
    )
    raw = (adapter.folder / MANIFEST_FILE).read_bytes()
    manifest = Manifest.from_json(raw)
    assert manifest == adapter.manifest
    assert manifest.canonical_bytes() == raw
    assert manifest.digest() == adapter.digest
    assert manifest.base_model_hash == base_hash
    assert dict(manifest.ranks) == {"q_proj": 4, "v_proj": 4} and manifest.max_rank == 4
    assert manifest.alpha == 16.0 and b'"alpha":16,' in raw
    assert set(manifest.files) == {"adapter_config.json", "adapter_model.safetensors"}


def test_fetch_verified_manifest(tmp_path, keys, base_dir, base_hash, s3, bucket):
    adapter = build_signed_adapter(tmp_path / "a", name="demo", version="v1", keys=keys, base_dir=base_dir)
    uri = push_adapter(adapter.folder, s3, bucket)
    assert uri == f"s3://{bucket}/demo/v1/"
    verified = fetch_verified_manifest(
        uri,
        trusted_keys=keys.trusted,
        expected_base_hash=base_hash,
        pinned_digest=adapter.digest,
        max_rank=8,
        s3_client=s3,
    )
    assert verified.digest == adapter.digest and verified.key_id == keys.key_id
    assert verified.manifest.name == "demo"


def test_pull_then_hit_without_download(tmp_path, keys, base_dir, base_hash, s3, bucket, retry):
    adapter = build_signed_adapter(tmp_path / "a", name="demo", version="v1", keys=keys, base_dir=base_dir)
    uri = push_adapter(adapter.folder, s3, bucket)
    cache = HostCache(tmp_path / "cache", 1 << 30, s3, retry=retry)
    local = cache.pull(uri, trusted_keys=keys.trusted, expected_base_hash=base_hash)
    assert local.digest == adapter.digest
    assert local.weights_path.read_bytes() == (adapter.folder / "adapter_model.safetensors").read_bytes()
    assert sorted(p.name for p in local.path.iterdir()) == sorted(
        [
            "adapter_config.json",
            "adapter_model.safetensors",
            "loraplane-manifest.json",
            "loraplane-manifest.sig",
        ]
    )
    again = cache.pull(
        uri, trusted_keys=keys.trusted, expected_base_hash=base_hash, pinned_digest=adapter.digest
    )
    assert again.path == local.path
    stats = cache.stats()
    assert stats["downloads"] == 2 and stats["hits"] >= 1 and stats["adapters"] == 1


def test_push_refuses_another_version_under_same_prefix(tmp_path, keys, base_dir, s3, bucket):
    first = build_signed_adapter(
        tmp_path / "a", name="demo", version="v1", keys=keys, base_dir=base_dir, seed=1
    )
    other = build_signed_adapter(
        tmp_path / "b", name="demo", version="v1", keys=keys, base_dir=base_dir, seed=2
    )
    push_adapter(first.folder, s3, bucket)
    push_adapter(first.folder, s3, bucket)  # idempotent for the same manifest
    with pytest.raises(E.ArtifactError) as err:
        push_adapter(other.folder, s3, bucket)
    assert err.value.reason == E.VERSION_EXISTS
    push_adapter(other.folder, s3, bucket, force=True)


def test_publish_adapter_helper(tmp_path, keys, base_hash, s3, bucket):
    published = publish_adapter(
        tmp_path, s3, bucket, name="helper", version="v3", keys=keys, base_hash=base_hash, rank=2
    )
    assert published.uri == f"s3://{bucket}/helper/v3/"
    verified = fetch_verified_manifest(
        published.uri,
        trusted_keys=keys.trusted,
        expected_base_hash=base_hash,
        pinned_digest=published.digest,
        s3_client=s3,
    )
    assert verified.manifest.max_rank == 2
