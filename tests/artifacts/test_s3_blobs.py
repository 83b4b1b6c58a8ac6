"""Content-addressed files in S3 (s3blobs.py): a push stores each distinct file once per bucket, a pull reads
it from its blob and checks it against the signed manifest, and artifacts pushed the old way (files under
their own prefix) still pull. moto's standalone server over HTTP."""

from __future__ import annotations

import pytest
from adapter_factory import build_signed_adapter, push_adapter
from s3_servers import FaultProxy
from tamper import assert_cache_holds_only_verified, manifest_dict, resign, upload_folder

from loraplane.artifacts import errors as E
from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.cli import main as cli
from loraplane.artifacts.manifest import MANIFEST_FILE, SIGNATURE_FILE
from loraplane.artifacts.pack import push_folder
from loraplane.artifacts.s3 import parse_s3_uri
from loraplane.artifacts.s3blobs import BLOB_ROOT, blob_key
from loraplane.artifacts.verify import Policy, fetch_verified_manifest, verify_folder

W, C = "adapter_model.safetensors", "adapter_config.json"


def keys_under(s3, bucket: str, prefix: str) -> dict[str, int]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix) :]: o["Size"] for page in pages for o in page.get("Contents", [])}


@pytest.fixture
def twins(tmp_path, keys, base_dir):
    """Two adapters, two names, the same files (same seed): a re-tagged copy."""
    return [
        build_signed_adapter(tmp_path / n, name=n, version="v1", keys=keys, base_dir=base_dir, seed=7)
        for n in ("alpha", "beta")
    ]


def pull(cache: HostCache, uri: str, keys, base_hash: str):
    return cache.pull(uri, trusted_keys=keys.trusted, expected_base_hash=base_hash)


def test_two_artifacts_with_the_same_files_store_them_once_and_both_pull(
    tmp_path, twins, keys, base_hash, s3, bucket, retry, moto
):
    a, b = twins
    assert a.manifest.files == b.manifest.files and a.digest != b.digest
    with FaultProxy(moto.url) as proxy:  # counts what reaches S3
        client = moto.client(url=proxy.url)
        first = push_folder(a.folder, f"s3://{bucket}/alpha/v1/", s3_client=client)
        second = push_folder(b.folder, f"s3://{bucket}/beta/v1/", s3_client=client)
        weights = "/" + blob_key(a.manifest.files[W].sha256)
        assert proxy.count("PUT", weights) == 1 and proxy.count("HEAD", weights) == 2
    total = a.manifest.total_bytes
    assert (first["uploaded_bytes"], first["deduplicated_bytes"]) == (total, 0)
    assert (second["uploaded_bytes"], second["deduplicated_bytes"]) == (0, total)
    blobs = keys_under(s3, bucket, BLOB_ROOT)
    assert blobs == {e.sha256: e.size for e in a.manifest.files.values()}  # one object per distinct file
    for name in ("alpha", "beta"):  # an artifact's prefix holds only its signed manifest
        assert set(keys_under(s3, bucket, f"{name}/v1/")) == {MANIFEST_FILE, SIGNATURE_FILE}

    cache = HostCache(tmp_path / "cache", 1 << 30, s3, retry=retry)
    for adapter in twins:
        local = pull(cache, f"s3://{bucket}/{adapter.manifest.name}/v1/", keys, base_hash)
        assert local.digest == adapter.digest and local.manifest.name == adapter.manifest.name
        assert local.weights_path.read_bytes() == (adapter.folder / W).read_bytes()
        verify_folder(local.path, trusted_keys=keys.trusted, policy=Policy(expected_base_hash=base_hash))
    assert cache.stats()["downloads"] == 2  # the second pull's files were already in the host cache
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


@pytest.mark.parametrize(
    "damage, reason, at_manifest_check",
    [
        ("truncated", E.FILE_SIZE_MISMATCH, True),  # HEAD shows the size before anything is pulled
        ("grown", E.FILE_SIZE_MISMATCH, True),
        ("replaced", E.FILE_HASH_MISMATCH, False),  # same size: only the streaming hash sees it
        ("deleted", E.MISSING_FILE, True),
    ],
)
def test_a_damaged_blob_is_refused_by_name_and_nothing_stays_cached(
    tmp_path, twins, keys, base_hash, s3, bucket, retry, damage, reason, at_manifest_check
):
    adapter = twins[0]
    uri = push_adapter(adapter.folder, s3, bucket)
    key, good = blob_key(adapter.manifest.files[W].sha256), (adapter.folder / W).read_bytes()
    if damage == "deleted":
        s3.delete_object(Bucket=bucket, Key=key)
    else:
        bad = {"truncated": good[: len(good) // 2], "grown": good + b"\0" * 8,
               "replaced": good[:-8] + bytes(8)}[damage]  # fmt: skip
        s3.put_object(Bucket=bucket, Key=key, Body=bad)
    check = dict(trusted_keys=keys.trusted, expected_base_hash=base_hash, s3_client=s3, retry=retry)
    if at_manifest_check:  # what the operator and a lazy registration run
        with pytest.raises(E.ArtifactError) as err:
            fetch_verified_manifest(uri, **check)
        assert (err.value.reason, err.value.field) == (reason, W), err.value
    else:
        fetch_verified_manifest(uri, **check)
    cache = HostCache(tmp_path / "cache", 1 << 30, s3, retry=retry)
    with pytest.raises(E.ArtifactError) as err:
        pull(cache, uri, keys, base_hash)
    assert (err.value.reason, err.value.field) == (reason, W), err.value
    assert not list((tmp_path / "cache" / "adapters").iterdir())
    assert not list((tmp_path / "cache" / "blobs").iterdir())  # not even the good config blob
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


def test_push_skips_a_stored_blob_and_force_uploads_it_again(
    tmp_path, twins, keys, base_hash, s3, bucket, retry
):
    """A blob of the right size but other bytes is caught by the pull; --force repairs it."""
    adapter = twins[0]
    uri = push_adapter(adapter.folder, s3, bucket)
    key, good = blob_key(adapter.manifest.files[W].sha256), (adapter.folder / W).read_bytes()
    s3.put_object(Bucket=bucket, Key=key, Body=good[:-8] + bytes(8))
    again = push_folder(adapter.folder, uri, s3_client=s3)
    assert again["uploaded_bytes"] == 0  # same size: a push cannot tell, and trusts the bucket
    with pytest.raises(E.ArtifactError) as err:
        pull(HostCache(tmp_path / "c1", 1 << 30, s3, retry=retry), uri, keys, base_hash)
    assert err.value.reason == E.FILE_HASH_MISMATCH
    forced = push_folder(adapter.folder, uri, s3_client=s3, force=True)
    assert forced["uploaded_bytes"] == adapter.manifest.total_bytes
    local = pull(HostCache(tmp_path / "c2", 1 << 30, s3, retry=retry), uri, keys, base_hash)
    assert local.weights_path.read_bytes() == good


@pytest.mark.parametrize(
    "digest", ["../../other-bucket/x", "A" * 64, "sha256:" + "a" * 64, "a" * 63, "a" * 64 + "/", "", 64]
)
def test_a_signed_manifest_naming_a_non_hex_digest_is_refused_by_field(
    tmp_path, twins, keys, base_hash, s3, bucket, retry, digest
):
    """Signed by a trusted key, yet its digest is no sha256: it never becomes an S3 key."""
    adapter = twins[0]
    manifest = manifest_dict(adapter.folder)
    manifest["files"][W]["sha256"] = digest
    resign(s3, bucket, "evil/v1/", manifest, keys.private_pem)
    check = dict(trusted_keys=keys.trusted, expected_base_hash=base_hash, s3_client=s3, retry=retry)
    with pytest.raises(E.ArtifactError) as err:
        fetch_verified_manifest(f"s3://{bucket}/evil/v1/", **check)
    assert err.value.reason == E.BAD_MANIFEST
    assert err.value.field == f"manifest.files.{W}.sha256", err.value
    with pytest.raises(E.ArtifactError) as err:
        pull(
            HostCache(tmp_path / "cache", 1 << 30, s3, retry=retry),
            f"s3://{bucket}/evil/v1/",
            keys,
            base_hash,
        )
    assert err.value.field == f"manifest.files.{W}.sha256"


@pytest.mark.parametrize("digest", ["../x", "A" * 64, "a" * 65, "a" * 63 + "\n", None])
def test_a_blob_key_is_only_ever_made_from_64_hex(digest):
    with pytest.raises(E.ArtifactError) as err:
        blob_key(digest, "manifest.files.x.sha256")
    assert (err.value.reason, err.value.field) == (E.BAD_MANIFEST, "manifest.files.x.sha256")
    assert blob_key("0f" * 32) == "_loraplane/blobs/sha256/" + "0f" * 32
    with pytest.raises(E.ArtifactError) as err:  # no artifact can be pushed into the blob root
        parse_s3_uri("s3://bucket/_loraplane/blobs/sha256/")
    assert err.value.reason == E.BAD_URI


def test_an_artifact_stored_the_old_way_still_verifies_pulls_and_converts_on_push(
    tmp_path, twins, keys, base_hash, s3, bucket, retry, moto, monkeypatch
):
    for key, value in moto.env().items():  # the CLI's client: boto3's standard chain
        monkeypatch.setenv(key, value)
    adapter = twins[0]
    upload_folder(s3, bucket, "alpha/v1/", adapter.folder)  # files under the prefix, no blobs
    uri = f"s3://{bucket}/alpha/v1/"
    assert not keys_under(s3, bucket, BLOB_ROOT)
    verified = fetch_verified_manifest(uri, trusted_keys=keys.trusted, expected_base_hash=base_hash,
                                       s3_client=s3, retry=retry)  # fmt: skip
    assert {n: (loc.key, loc.blob) for n, loc in verified.locations.items()} == {
        n: (f"alpha/v1/{n}", False) for n in (C, W)
    }
    local = pull(HostCache(tmp_path / "c1", 1 << 30, s3, retry=retry), uri, keys, base_hash)
    assert local.weights_path.read_bytes() == (adapter.folder / W).read_bytes()
    assert cli(["verify", uri, "--trusted-keys", str(keys.trusted_dir), "--base-hash", base_hash, "-q"]) == 0
    push_folder(adapter.folder, uri, s3_client=s3)  # the same version again: its files move to blobs
    assert set(keys_under(s3, bucket, "alpha/v1/")) == {MANIFEST_FILE, SIGNATURE_FILE}
    assert len(keys_under(s3, bucket, BLOB_ROOT)) == 2
    local = pull(HostCache(tmp_path / "c2", 1 << 30, s3, retry=retry), uri, keys, base_hash)
    assert local.weights_path.read_bytes() == (adapter.folder / W).read_bytes()
    assert cli(["verify", uri, "--trusted-keys", str(keys.trusted_dir), "--base-hash", base_hash, "-q"]) == 0
