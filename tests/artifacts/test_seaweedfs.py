"""Integration with a real S3 server, SeaweedFS (``weed mini``): SigV4 auth, versioning, checksums.

One instance per machine (fixed ports); the session fixture skips with the reason when it cannot run.
"""

from __future__ import annotations

import pytest
from adapter_factory import build_signed_adapter, push_adapter
from tamper import assert_cache_holds_only_verified

from loraplane.artifacts import errors as E
from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.s3 import make_client
from loraplane.artifacts.s3blobs import blob_key
from loraplane.artifacts.verify import fetch_verified_manifest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def weed_bucket(seaweedfs):
    client = seaweedfs.client()
    client.create_bucket(Bucket="adapters")
    client.put_bucket_versioning(Bucket="adapters", VersioningConfiguration={"Status": "Enabled"})
    return "adapters"


def test_push_verify_pull_through_the_standard_credential_chain(
    tmp_path, seaweedfs, weed_bucket, keys, base_dir, base_hash, monkeypatch, retry
):
    adapter = build_signed_adapter(
        tmp_path / "a", name="demo", version="v1", keys=keys, base_dir=base_dir, rank=8
    )
    # multipart: a 5 MiB part threshold with a ~6 MiB weights file (SeaweedFS enforces the S3 rules)
    from loraplane.artifacts.pack import push_folder

    smollm2_shapes = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, num_hidden_layers=20)  # fmt: skip
    big = build_signed_adapter(
        tmp_path / "big", name="big", version="v1", keys=keys, base_hash=base_hash, rank=8, base_config=smollm2_shapes,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )  # fmt: skip
    assert big.manifest.files["adapter_model.safetensors"].size > 6 << 20
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    client = make_client()  # credentials and endpoint from the environment only
    uri = push_adapter(adapter.folder, client, weed_bucket)
    big_uri = push_folder(big.folder, f"s3://{weed_bucket}/big/v1/", s3_client=client, chunk_bytes=5 << 20)[
        "uri"
    ]
    weights_blob = blob_key(big.manifest.files["adapter_model.safetensors"].sha256)
    head = client.head_object(Bucket=weed_bucket, Key=weights_blob)
    assert "-" in head["ETag"], "uploaded in parts"
    verified = fetch_verified_manifest(
        uri,
        trusted_keys=keys.trusted,
        expected_base_hash=base_hash,
        pinned_digest=adapter.digest,
        s3_client=client,
    )
    assert verified.key_id == keys.key_id
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    for u, a in ((uri, adapter), (big_uri, big)):
        local = cache.pull(u, trusted_keys=keys.trusted, expected_base_hash=base_hash)
        assert local.weights_path.read_bytes() == (a.folder / "adapter_model.safetensors").read_bytes()
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


def test_wrong_secret_is_access_denied(tmp_path, seaweedfs, weed_bucket, keys, base_hash, retry):
    client = seaweedfs.client(secret_key="not-the-secret")
    with pytest.raises(E.ArtifactError) as err:
        fetch_verified_manifest(
            f"s3://{weed_bucket}/demo/v1/",
            trusted_keys=keys.trusted,
            expected_base_hash=base_hash,
            s3_client=client,
            retry=retry,
        )
    assert err.value.reason == E.ACCESS_DENIED
    assert "SignatureDoesNotMatch" in err.value.message


def test_overwritten_object_is_caught_even_with_versioning(
    tmp_path, seaweedfs, weed_bucket, keys, base_dir, base_hash, retry
):
    """An attacker with write access replaces the weights (a new object version): the pull refuses it."""
    adapter = build_signed_adapter(tmp_path / "a", name="victim", version="v1", keys=keys, base_dir=base_dir)
    client = seaweedfs.client()
    uri = push_adapter(adapter.folder, client, weed_bucket)
    data = bytearray((adapter.folder / "adapter_model.safetensors").read_bytes())
    data[-4:] = b"evil"
    key = blob_key(adapter.manifest.files["adapter_model.safetensors"].sha256)  # where push stored it
    stored = len(client.list_object_versions(Bucket=weed_bucket, Prefix=key)["Versions"])
    client.put_object(Bucket=weed_bucket, Key=key, Body=bytes(data))
    versions = client.list_object_versions(Bucket=weed_bucket, Prefix=key)["Versions"]
    assert len(versions) == stored + 1 >= 2
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    with pytest.raises(E.ArtifactError) as err:
        cache.pull(uri, trusted_keys=keys.trusted, expected_base_hash=base_hash)
    assert err.value.reason == E.FILE_HASH_MISMATCH
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)
