"""Fixtures for the adapter supply-chain tests: one moto server per session, SeaweedFS when it can run."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

# --import-mode=importlib adds nothing to sys.path: make tests/ (s3_servers, adapter_factory) and this
# folder (tamper helpers) importable.
for _path in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from adapter_factory import make_base_folder, make_keys  # noqa: E402
from s3_servers import FaultProxy, SeaweedUnavailable, moto_server, seaweedfs_server  # noqa: E402

from loraplane.artifacts.base_hash import compute_base_hash  # noqa: E402
from loraplane.artifacts.s3 import RetryPolicy  # noqa: E402


@pytest.fixture
def retry() -> RetryPolicy:
    """Retries that keep the fault tests fast: 4 attempts, a few ms apart."""
    return RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)


@pytest.fixture(scope="session")
def moto():
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(moto) -> str:
    return moto.create_bucket(f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def s3(moto):
    return moto.client()


@pytest.fixture(scope="session")
def keys(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory) -> Path:
    return make_base_folder(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="session")
def base_hash(base_dir) -> str:
    return compute_base_hash(base_dir)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    try:
        with seaweedfs_server(tmp_path_factory.mktemp("seaweedfs")) as endpoint:
            yield endpoint
    except SeaweedUnavailable as exc:
        pytest.skip(f"SeaweedFS cannot run here: {exc}")


@pytest.fixture(scope="module")
def proxy(moto):
    """A FaultProxy in front of moto, one per test module (the host-cache tests count the GETs it sees)."""
    with FaultProxy(moto.url) as p:
        yield p


@pytest.fixture
def client(moto, proxy):
    """A boto3 client through the module's proxy, its faults and counts reset."""
    proxy.reset()
    return moto.client(url=proxy.url)
