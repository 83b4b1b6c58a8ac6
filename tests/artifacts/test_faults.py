"""S3 faults between the cache and the server, injected by a proxy: retried with backoff, then reported."""

from __future__ import annotations

import pytest
from adapter_factory import build_signed_adapter, push_adapter
from s3_servers import Fault, FaultProxy
from tamper import assert_cache_holds_only_verified

from loraplane.artifacts import errors as E
from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.s3blobs import BLOB_ROOT, blob_key

W = "/" + BLOB_ROOT + "<weights>"  # the weights' blob; the digest is known once the adapter is built


def at(fault: Fault, adapter) -> Fault:
    """The fault aimed at the adapter's weights blob when it names W."""
    if fault.path == W:
        fault.path = "/" + blob_key(adapter.manifest.files["adapter_model.safetensors"].sha256)
    return fault


@pytest.fixture(scope="module")
def pushed(tmp_path_factory, moto, keys, base_dir):
    bucket = moto.create_bucket("faults")
    adapter = build_signed_adapter(
        tmp_path_factory.mktemp("a") / "x", name="demo", version="v1", keys=keys, base_dir=base_dir
    )
    return push_adapter(adapter.folder, moto.client(), bucket), adapter


@pytest.fixture(scope="module")
def _proxy(moto):
    with FaultProxy(moto.url) as p:
        yield p


@pytest.fixture
def proxy(_proxy):
    _proxy.reset()
    return _proxy


def blob_weights(adapter) -> str:
    return "/" + blob_key(adapter.manifest.files["adapter_model.safetensors"].sha256)


def _pull(tmp_path, moto, proxy, keys, base_hash, uri, retry):
    client = moto.client(url=proxy.url, read_timeout=1.0, connect_timeout=1.0)
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    return cache, cache.pull(uri, trusted_keys=keys.trusted, expected_base_hash=base_hash)


@pytest.mark.parametrize(
    "fault",
    [
        Fault("status", W, status=503, code="ServiceUnavailable", times=2),
        Fault("status", W, status=503, code="SlowDown", times=1),
        Fault("status", W, status=500, code="InternalError", times=1),
        Fault("status", W, method="HEAD", status=503, code="SlowDown", times=2),  # the blob's size check
        Fault("status", "/loraplane-manifest.json", status=503, code="SlowDown", times=2),
        Fault("status", "/faults", status=503, code="SlowDown", times=1),  # the listing
        Fault("hang", W, hang_s=3.0),  # the client's 1 s read timeout fires
        Fault("truncate", W),  # full Content-Length announced, half sent
        Fault("short_length", W),  # half announced and sent: shorter than the manifest says
    ],
    ids=lambda f: f"{f.kind}-{f.method}-{f.status if f.kind == 'status' else ''}-{f.path.rsplit('/', 1)[-1]}",
)
def test_transient_fault_is_retried(fault, tmp_path, moto, proxy, keys, base_hash, pushed, retry):
    uri, adapter = pushed
    proxy.add(at(fault, adapter))
    cache, local = _pull(tmp_path, moto, proxy, keys, base_hash, uri, retry)
    assert local.digest == adapter.digest
    assert fault.times == 0, "the fault was injected"
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


@pytest.mark.parametrize("kind", ["status", "truncate"])
def test_persistent_fault_reports_source_unreachable(
    kind, tmp_path, moto, proxy, keys, base_hash, pushed, retry
):
    uri, adapter = pushed
    W = blob_weights(adapter)
    proxy.add(Fault(kind, W, times=100))
    with pytest.raises(E.ArtifactError) as err:
        _pull(tmp_path, moto, proxy, keys, base_hash, uri, retry)
    assert err.value.reason == E.SOURCE_UNREACHABLE and err.value.transient
    assert "4 attempt(s) failed" in err.value.message
    assert proxy.count("GET", W) == retry.attempts
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []
    assert_cache_holds_only_verified(tmp_path / "cache", keys.trusted)


@pytest.mark.parametrize(
    "status,code,reason",
    [
        (403, "AccessDenied", E.ACCESS_DENIED),
        (404, "NoSuchKey", E.NOT_FOUND),
        (400, "InvalidRequest", E.SOURCE_UNREACHABLE),
    ],
)
def test_final_errors_are_not_retried(
    status, code, reason, tmp_path, moto, proxy, keys, base_hash, pushed, retry
):
    uri, adapter = pushed
    W = blob_weights(adapter)
    proxy.add(Fault("status", W, status=status, code=code, times=100))
    with pytest.raises(E.ArtifactError) as err:
        _pull(tmp_path, moto, proxy, keys, base_hash, uri, retry)
    assert err.value.reason == reason
    assert proxy.count("GET", W) == 1


def test_unreachable_endpoint(tmp_path, moto, keys, base_hash, pushed, retry):
    from s3_servers import free_port

    uri, _ = pushed
    client = moto.client(url=f"http://127.0.0.1:{free_port()}", connect_timeout=0.5)
    cache = HostCache(tmp_path / "cache", 1 << 30, client, retry=retry)
    with pytest.raises(E.ArtifactError) as err:
        cache.pull(uri, trusted_keys=keys.trusted, expected_base_hash=base_hash)
    assert err.value.reason == E.SOURCE_UNREACHABLE
    assert "EndpointConnectionError" in err.value.message or "Connect" in err.value.message
