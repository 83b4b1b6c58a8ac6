"""What the host cache trusts on a hit without hashing: a blob this process verified (downloaded from a
verified stream, or hashed once its content had settled) that kept its identity (device, inode, size,
mtime, ctime) since. Counted by ``stats()["hash_passes"]``: the cached files hashed again on a hit."""

from __future__ import annotations

import os

import pytest
from adapter_factory import build_signed_adapter, push_adapter
from tamper import assert_cache_holds_only_verified, pull_from

from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.s3blobs import blob_key

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def twins(tmp_path_factory, moto, keys, base_dir):
    """Two versions with the same files (one weights blob, one config blob): adapters of one shape."""
    bucket, client = moto.create_bucket("memo-tests"), moto.client()
    out = {}
    for version in ("v1", "v2"):
        folder = tmp_path_factory.mktemp(version) / "a"
        a = build_signed_adapter(folder, name="twin", version=version, keys=keys, base_dir=base_dir, seed=7)
        out[version] = (push_adapter(a.folder, client, bucket), a)
    return out


def _weights_gets(proxy, adapter) -> int:
    return proxy.count("GET", "/" + blob_key(adapter.manifest.files[WEIGHTS].sha256))


def test_a_blob_this_process_verified_is_not_hashed_again(
    tmp_path, client, proxy, twins, keys, base_hash, retry
):
    (uri1, a1), (uri2, _) = twins["v1"], twins["v2"]
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    one = pull_from(cache, uri1, keys, base_hash)
    two = pull_from(cache, uri2, keys, base_hash)  # both its files are cached blobs
    pull_from(cache, uri1, keys, base_hash)  # its folder is cached
    assert os.path.samefile(one.weights_path, two.weights_path)
    assert (cache.stats()["downloads"], cache.stats()["hash_passes"]) == (2, 0)
    assert cache.verified_identity(two.weights_path, a1.manifest.files[WEIGHTS].sha256) is not None

    other = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)  # another process: no memo
    for uri in (uri2, uri1, uri2):
        pull_from(other, uri, keys, base_hash)
    assert other.stats()["hash_passes"] == 2  # each file once, then remembered
    assert _weights_gets(proxy, a1) == 1


def test_the_memo_is_bounded_least_recently_used_first(tmp_path, client, twins, keys, base_hash, retry):
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    cache.verified_max = 1
    one = pull_from(cache, twins["v1"][0], keys, base_hash)
    files = list(one.manifest.files.items())  # downloaded (and remembered) in this order
    vouched = [cache.verified_identity(one.path / n, e.sha256) is not None for n, e in files]
    assert vouched == [False, True]
    pull_from(cache, twins["v2"][0], keys, base_hash)  # the first is hashed; remembering it drops the second
    assert cache.stats()["hash_passes"] == 2


def test_a_blob_written_after_it_was_verified_is_hashed_and_fetched_again(
    tmp_path, client, proxy, twins, keys, base_hash, retry
):
    """A write with the mode and mtime put back leaves only the ctime moved: enough to hash it again."""
    (uri1, a1), (uri2, a2) = twins["v1"], twins["v2"]
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    one = pull_from(cache, uri1, keys, base_hash)
    blob = tmp_path / "cache" / "blobs" / a1.manifest.files[WEIGHTS].sha256
    assert os.path.samefile(blob, one.weights_path)
    stat = blob.stat()
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    os.chmod(blob, stat.st_mode)
    os.utime(blob, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert blob.stat().st_size == stat.st_size and blob.stat().st_mtime_ns == stat.st_mtime_ns

    two = pull_from(cache, uri2, keys, base_hash)  # finds the blob cached, hashes it, evicts it, downloads it
    assert two.weights_path.read_bytes() == (a2.folder / WEIGHTS).read_bytes()
    assert cache.stats()["hash_passes"] == 1 and cache.stats()["corrupt_evictions"] == 1
    assert _weights_gets(proxy, a1) == 2

    again = pull_from(
        cache, uri1, keys, base_hash
    )  # its folder still links the written file: hashed, refetched
    assert again.weights_path.read_bytes() == (a1.folder / WEIGHTS).read_bytes()
    assert cache.stats()["corrupt_evictions"] == 2
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)
