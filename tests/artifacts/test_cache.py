"""Host cache semantics: single download under concurrency, shared blobs, LRU budget, pins, in-use,
corruption found on read, and no S3 round trip for a pinned digest that is already cached."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from adapter_factory import build_signed_adapter, push_adapter
from tamper import assert_cache_holds_only_verified, pull_from

from loraplane.artifacts import errors as E
from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.s3blobs import blob_key


def blob(adapter, name: str = "adapter_model.safetensors") -> str:
    """The URL path's tail of a file's S3 blob (what the proxy counts)."""
    return "/" + blob_key(adapter.manifest.files[name].sha256)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, moto, keys, base_dir):
    """Three versions with identical adapter_config.json (shared blob) and different weights (~8 KB each)."""
    bucket, client = moto.create_bucket("cache-tests"), moto.client()
    out = {}
    for i, version in enumerate(["v1", "v2", "v3"]):
        a = build_signed_adapter(
            tmp_path_factory.mktemp(version) / "a",
            name="demo",
            version=version,
            keys=keys,
            base_dir=base_dir,
            seed=i,
        )
        out[version] = (push_adapter(a.folder, client, bucket), a)
    return out


def test_16_parallel_pulls_download_once(tmp_path, client, proxy, adapters, keys, base_hash, retry):
    uri, adapter = adapters["v1"]
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: pull_from(cache, uri, keys, base_hash), range(16)))
    assert {r.path for r in results} == {results[0].path}
    assert {r.digest for r in results} == {adapter.digest}
    assert (
        proxy.count("GET", blob(adapter)) == 1
        and proxy.count("GET", blob(adapter, "adapter_config.json")) == 1
    )
    assert cache.stats()["downloads"] == 2
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


def _pull_in_process(args):
    root, url, uri, trusted, base_hash = args
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing",
        config=Config(s3={"addressing_style": "path"}),
    )  # fmt: skip
    local = HostCache(root, 1 << 30, client).pull(uri, trusted_keys=trusted, expected_base_hash=base_hash)
    return str(local.path)


def test_parallel_processes_download_once(tmp_path, client, proxy, adapters, keys, base_hash):
    uri, adapter = adapters["v2"]
    ctx = multiprocessing.get_context("fork")
    job = (str(tmp_path / "cache"), proxy.url, uri, keys.trusted, base_hash)
    with ctx.Pool(4) as pool:
        paths = pool.map(_pull_in_process, [job] * 4)
    assert len(set(paths)) == 1
    assert proxy.count("GET", blob(adapter)) == 1


def test_versions_share_identical_files(tmp_path, client, adapters, keys, base_hash, retry):
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    one, two = (pull_from(cache, adapters[v][0], keys, base_hash) for v in ("v1", "v2"))
    assert one.digest != two.digest
    assert os.path.samefile(one.config_path, two.config_path)  # one blob, two hard links
    assert cache.stats()["blobs"] == 3


def test_lru_eviction_respects_pins_and_in_use(tmp_path, client, adapters, keys, base_hash, retry):
    weights = adapters["v1"][1].manifest.files["adapter_model.safetensors"].size
    config = adapters["v1"][1].manifest.files["adapter_config.json"].size
    budget = config + 2 * weights + 100  # room for two versions, not three
    cache = HostCache(tmp_path / "cache", budget, client, retry=retry)
    v1, v2 = (pull_from(cache, adapters[v][0], keys, base_hash) for v in ("v1", "v2"))
    pull_from(cache, adapters["v1"][0], keys, base_hash)  # v1 is now more recently used than v2
    v3 = pull_from(cache, adapters["v3"][0], keys, base_hash)
    assert {e["version"] for e in cache.entries()} == {"v1", "v3"}
    assert not v2.path.exists() and v1.path.exists()

    cache.pin(v1.digest)
    with cache.in_use(v3.digest):
        with pytest.raises(E.ArtifactError) as err:
            pull_from(cache, adapters["v2"][0], keys, base_hash)
        assert err.value.reason == E.CACHE_FULL
    pull_from(cache, adapters["v2"][0], keys, base_hash)  # v3 is idle again: it goes, pinned v1 stays
    assert {e["version"] for e in cache.entries()} == {"v1", "v2"}
    assert cache.used_bytes() <= budget
    cache.unpin(v1.digest)
    assert cache.stats()["evictions"] == 2
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


def test_a_pull_waits_for_room_held_in_use_and_never_for_pinned_room(
    tmp_path, client, adapters, keys, base_hash, retry
):
    """A burst of pulls into a budget of one version: the second waits for the first one's use (its load)
    to end, then takes its room. Room that pinned versions hold is never waited for."""
    weights = adapters["v1"][1].manifest.files["adapter_model.safetensors"].size
    config = adapters["v1"][1].manifest.files["adapter_config.json"].size
    cache = HostCache(tmp_path / "cache", config + weights + 100, client, retry=retry, room_wait_s=30)
    v1 = pull_from(cache, adapters["v1"][0], keys, base_hash, acquire=True)  # its load is under way
    done_loading = threading.Timer(0.3, cache.release, args=(v1.digest,))
    done_loading.start()
    v2 = pull_from(cache, adapters["v2"][0], keys, base_hash)
    done_loading.join()
    assert v2.path.exists() and not v1.path.exists()
    cache.pin(v2.digest)
    started = time.monotonic()
    with pytest.raises(E.ArtifactError) as err:
        pull_from(cache, adapters["v3"][0], keys, base_hash)
    assert err.value.reason == E.CACHE_FULL
    assert time.monotonic() - started < 10  # failed at once, not after the 30 s wait
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


def test_in_use_is_respected_across_caches_of_other_processes(
    tmp_path, client, adapters, keys, base_hash, retry
):
    weights = adapters["v1"][1].manifest.files["adapter_model.safetensors"].size
    config = adapters["v1"][1].manifest.files["adapter_config.json"].size
    holder = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    v1 = pull_from(holder, adapters["v1"][0], keys, base_hash, acquire=True)
    other = HostCache(
        tmp_path / "cache", config + weights + 100, client, retry=retry
    )  # another process's view
    assert not other.evict(v1.digest)  # the holder's shared lock keeps it
    holder.release(v1.digest)
    assert other.evict(v1.digest) and not v1.path.exists()


def test_corrupt_entry_is_evicted_and_fetched_again(
    tmp_path, client, proxy, adapters, keys, base_hash, retry
):
    uri, adapter = adapters["v1"]
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    local = pull_from(cache, uri, keys, base_hash)
    os.chmod(local.weights_path, 0o644)
    with open(local.weights_path, "r+b") as f:  # bit rot in place (the blob is the same inode)
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    again = pull_from(cache, uri, keys, base_hash)
    assert again.weights_path.read_bytes() == (adapter.folder / "adapter_model.safetensors").read_bytes()
    assert proxy.count("GET", blob(adapter)) == 2
    assert cache.stats()["corrupt_evictions"] == 1
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


def test_pinned_digest_already_cached_needs_no_s3(tmp_path, client, proxy, adapters, keys, base_hash, retry):
    uri, adapter = adapters["v1"]
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    pull_from(cache, uri, keys, base_hash)
    proxy.reset()
    local = pull_from(cache, uri, keys, base_hash, pinned_digest=adapter.digest)
    assert local.digest == adapter.digest
    assert sum(proxy.requests.values()) == 0


def test_cached_entry_still_checked_against_caller_policy(tmp_path, client, adapters, keys, base_hash, retry):
    """A cached adapter is not served to a caller whose base or trust differs: re-verified on every pull."""
    uri, adapter = adapters["v1"]
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    pull_from(cache, uri, keys, base_hash)
    for kwargs, reason in [
        ({"expected_base_hash": "e" * 64}, E.BASE_MISMATCH),
        ({"trusted_keys": {"0" * 16: keys.public_pem}}, E.UNKNOWN_KEY),
        ({"max_rank": 2}, E.RANK_TOO_HIGH),
    ]:
        check = {"trusted_keys": keys.trusted, "expected_base_hash": base_hash, **kwargs}
        with pytest.raises(E.ArtifactError) as err:
            cache.pull(uri, pinned_digest=adapter.digest, **check)
        assert err.value.reason == reason
    assert len(cache.entries()) == 1  # valid for other callers: not evicted


def test_damaged_cached_signature_is_refetched(tmp_path, client, proxy, adapters, keys, base_hash, retry):
    uri, adapter = adapters["v2"]
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    local = pull_from(cache, uri, keys, base_hash)
    (local.path / "loraplane-manifest.sig").unlink()
    again = pull_from(cache, uri, keys, base_hash, pinned_digest=adapter.digest)
    assert (again.path / "loraplane-manifest.sig").is_file()
    assert cache.stats()["corrupt_evictions"] == 1
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


def test_a_pull_killed_with_kill_9_is_cleaned_up_at_the_nextpull_from(
    tmp_path, client, proxy, adapters, keys, base_hash
):
    """The killed pull's .part and build folder go when any pull starts, not an hour later."""
    import signal
    import time

    from s3_servers import Fault

    root = tmp_path / "cache"
    cache = HostCache(
        root, 1 << 30, client
    )  # made before the crash: its start-up sweep cannot be what cleans
    proxy.add(Fault("stall", path=blob(adapters["v3"][1]), hang_s=60))  # half of the weights, then silence
    child = multiprocessing.get_context("fork").Process(
        target=_pull_in_process, args=((str(root), proxy.url, adapters["v3"][0], keys.trusted, base_hash),)
    )
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not list((root / "tmp").glob("*.part")) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = sorted(p.name for p in (root / "tmp").iterdir())
        assert any(n.endswith(".part") for n in left) and any(n.startswith("adapter-") for n in left), left
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    assert sorted(p.name for p in (root / "tmp").iterdir()) == left, "nothing cleans up before the next pull"
    proxy.reset()
    pull_from(cache, adapters["v1"][0], keys, base_hash)  # another adapter's pull starts: the sweep runs
    assert list((root / "tmp").iterdir()) == []
    assert cache.counters["swept"] == 2
    pull_from(cache, adapters["v3"][0], keys, base_hash)  # and the killed pull's adapter now pulls cleanly
    assert_cache_holds_only_verified(root, keys.trusted)
