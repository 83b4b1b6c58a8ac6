"""Real signed adapters for the tiny chat model, in moto S3, and a public + admin server pair over one engine.

with adapter_world(tmp, engine, model_dir) as world:   # world.public / world.admin: ServerThread
    world.put("chat", world.published["chat-v1"])       # PUT /admin/adapters/chat
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.manifest import MANIFEST_FILE, Manifest
from loraplane.http.adapters import AdapterRegistry
from loraplane.http.admin import create_admin_app
from loraplane.http.app import create_app
from loraplane.serve.sources import S3Source
from tests.adapter_factory import (
    Keys,
    PublishedAdapter,
    make_keys,
    publish_adapter,
    push_adapter,
    resign_edited,
)
from tests.http.conftest import MODEL_NAME, ServerThread
from tests.s3_servers import FaultProxy, moto_server

ADMIN_TOKEN = "admin-token-0123456789"
BUCKET = "adapters"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class AdapterWorld:
    public: ServerThread
    admin: ServerThread
    source: S3Source
    registry: AdapterRegistry
    published: dict[str, PublishedAdapter] = field(default_factory=dict)
    keys: Keys | None = None  # the trusted signing key
    s3: object = None  # a boto3 client of the bucket's server
    proxy: FaultProxy | None = None  # between the pod and S3, when asked for

    def publish_edited(self, adapter: PublishedAdapter, version: str, edit, **manifest) -> PublishedAdapter:
        """A signed copy of ``adapter`` as ``version``, its files edited past pack's checks, in S3."""
        folder = self.published_dir / f"{adapter.manifest.name}-{version}"
        digest = resign_edited(adapter.folder, folder, self.keys, edit, version=version, **manifest)
        uri = push_adapter(folder, self.s3, BUCKET)
        return PublishedAdapter(uri, digest, folder, Manifest.from_json((folder / MANIFEST_FILE).read_bytes()),
                                adapter.key_id)  # fmt: skip

    @property
    def published_dir(self) -> Path:
        return next(iter(self.published.values())).folder.parent

    def put(self, name: str, adapter: PublishedAdapter, **extra) -> httpx.Response:
        body = {"uri": adapter.uri, "version": adapter.manifest.version, "manifest_digest": adapter.digest,
                "pin": False, "warm": "gpu", **extra}  # fmt: skip
        return httpx.put(
            f"{self.admin.url}/admin/adapters/{name}", json=body, headers=ADMIN_HEADERS, timeout=60
        )

    def admin_get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.admin.url + path, headers=ADMIN_HEADERS, timeout=30, **kw)

    def delete(self, name: str, version: str | None = None) -> httpx.Response:
        params = {"version": version} if version else None
        return httpx.delete(f"{self.admin.url}/admin/adapters/{name}", params=params, headers=ADMIN_HEADERS)

    def versions(self, name: str) -> dict[str, dict]:
        body = self.admin_get("/admin/adapters", params={"name": name}).json()
        return {v["version"]: v for v in body["adapters"]}


@contextlib.contextmanager
def s3_env(endpoint) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in endpoint.env()}
    os.environ.update(endpoint.env())
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def publish_all(workdir: Path, client, model_dir: Path, keys, other_keys) -> dict[str, PublishedAdapter]:
    """chat v1/v2 and support v1 (good), plus one signed by an untrusted key and one for another base."""
    common = dict(base_dir=model_dir, rank=4, target_modules=("q_proj", "v_proj"), scale=0.5)
    out = {}
    for name, version, seed in (
        ("chat", "v1", 1),
        ("chat", "v2", 2),
        ("support", "v1", 3),
        ("tenant-b", "v1", 4),
    ):
        out[f"{name}-{version}"] = publish_adapter(workdir, client, BUCKET, name=name, version=version, keys=keys,
                                                   seed=seed, **common)  # fmt: skip
    out["rogue-v1"] = publish_adapter(workdir, client, BUCKET, name="rogue", version="v1", keys=other_keys,
                                      seed=5, **common)  # fmt: skip
    out["elsewhere-v1"] = publish_adapter(workdir, client, BUCKET, name="elsewhere", version="v1", keys=keys,
                                          base_hash="ab" * 32, base_config=None, rank=4, seed=6)  # fmt: skip
    return out


@contextlib.contextmanager
def adapter_world(workdir: Path, engine, model_dir: Path, *, api_keys=None, wait_s: float = 5.0,
                  metrics=None, routing_metrics: bool = False, s3_proxy: bool = False) -> Iterator[AdapterWorld]:  # fmt: skip
    """``s3_proxy``: the pod reaches S3 through a FaultProxy (``world.proxy``) that can hold or break objects."""
    keys, other_keys = make_keys(workdir / "keys"), make_keys(workdir / "other-keys")
    with moto_server() as endpoint, s3_env(endpoint), contextlib.ExitStack() as stack:
        proxy = stack.enter_context(FaultProxy(endpoint.url)) if s3_proxy else None
        endpoint.create_bucket(BUCKET)
        published = publish_all(workdir / "published", endpoint.client(), model_dir, keys, other_keys)
        app = create_app(engine, engine.engine.tokenizer, MODEL_NAME, api_keys, metrics=metrics,
                         routing_metrics=routing_metrics)  # fmt: skip
        state = app.state.server
        cache_dir = workdir / "cache"
        cache_dir.mkdir()
        if proxy is None:
            source = S3Source.create(cache_dir, 1 << 30, keys.trusted, engine.info)
        else:  # a long read timeout: a test holds an object at the proxy's gate on purpose
            client = endpoint.client(url=proxy.url, read_timeout=120)
            source = S3Source(HostCache(cache_dir / "adapters", 1 << 30, client), keys.trusted, engine.info)
        registry = AdapterRegistry(
            engine, state.metrics, source.pull, source.release, source.pin, source.inspect
        )
        state.metrics.watch_engine(engine, source.cache)
        admin = create_admin_app(state, ADMIN_TOKEN, registry, wait_s=wait_s)
        with ServerThread(app) as public, ServerThread(admin) as admin_server:
            world = AdapterWorld(
                public, admin_server, source, registry, published, keys, endpoint.client(), proxy
            )
            try:
                yield world
            finally:
                for name in {a.manifest.name for a in published.values()}:
                    world.delete(name)
