"""Run the real operator (kopf + the kubernetes client) against the emulator, in a thread of its own.

``OperatorThread`` uses kopf's ``spawn_tasks`` + ``run_tasks`` in its own event loop, so the test
thread stays synchronous and the emulator's thread serves both. ``World`` sets up one namespace:
Secrets, a LoRABase whose pods are fake admin servers, and helpers to create adapters and wait.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import threading
import time
from typing import Any

import kopf

from loraplane.operator import builders as B
from loraplane.operator import handlers
from loraplane.operator.context import Context, Tunables
from loraplane.operator.kube import Kube
from loraplane.operator.policy import SECRET_LABEL, OperatorPolicy
from tests.operator.fake_admin import FakePod

API = "loraplane.dev/v1alpha1"
TOKEN = "test-admin-token"
_ips = itertools.count(2)  # 127.0.0.N for fake pods, unique across the test session
# The S3 endpoints the test Worlds use (their moto server, and a port where nothing listens): the
# operator's default policy in these tests allows exactly these.
TEST_ENDPOINTS: set[str] = {"http://127.0.0.1:9"}


def fast_tunables(**overrides) -> Tunables:
    values = dict(drift_interval=1.0, poll_interval=0.3, retry_delay=0.5, max_retry_delay=2.0,
                  admin_connect_timeout=0.5, admin_read_timeout=1.5, s3_attempts=1)  # fmt: skip
    values.update(overrides)
    return Tunables(**values)


class OperatorThread:
    def __init__(
        self, emulator, namespace: str, tunables: Tunables | None = None, policy: OperatorPolicy | None = None
    ):
        policy = policy or OperatorPolicy(allowed_s3_endpoints=tuple(sorted(TEST_ENDPOINTS)))
        self.ctx = Context(Kube(emulator.api_client()), tunables or fast_tunables(), policy=policy)
        self.namespace = namespace
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"operator-{namespace}", daemon=True)

    def __enter__(self) -> OperatorThread:
        self._thread.start()
        assert self.ready_flag.wait(30), f"the operator did not start: {self.failure!r}"
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.stop_flag.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the operator did not stop"

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported by __enter__
            self.failure = exc
            self.ready_flag.set()

    async def _main(self) -> None:
        settings = handlers.make_settings(standalone=True)
        settings.watching.server_timeout = 20
        settings.watching.client_timeout = 25
        settings.networking.request_timeout = 30
        settings.background.cancellation_polling = 0.2
        ignored = asyncio.all_tasks()
        tasks = await kopf.spawn_tasks(
            registry=kopf.get_default_registry(),
            settings=settings,
            memo=kopf.Memo(ctx=self.ctx),
            standalone=True,
            namespaces=[self.namespace],
            stop_flag=self.stop_flag,
            ready_flag=self.ready_flag,
        )
        await kopf.run_tasks(tasks, ignored=ignored)


def wait_for(check, timeout: float = 30.0, interval: float = 0.1, what: str = ""):
    """Poll ``check()`` until truthy; its last value (or exception) explains a timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - a missing object is "not yet"
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what or check}: last {last!r}")


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


class World:
    """One namespace with a LoRABase ``demo`` whose ready pods are fake admin servers."""

    def __init__(self, emulator, namespace: str, *, s3, keys, base_hash: str, port: int, max_rank: int = 16):
        self.emu, self.ns, self.s3, self.keys, self.base_hash, self.port = (
            emulator,
            namespace,
            s3,
            keys,
            base_hash,
            port,
        )
        self.pods: dict[str, FakePod] = {}  # pod name -> fake server
        self.max_rank = max_rank
        TEST_ENDPOINTS.add(s3.url)
        emulator.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        self.secret("admin-token", {"token": TOKEN})
        self.secret("signers", {"release.pem": keys.public_pem.decode()})
        self.secret("s3", {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key})

    def secret(self, name: str, data: dict[str, str], labeled: bool = True) -> None:
        """A Secret; ``labeled``: carries the label that lets the operator use it."""
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        metadata = {"name": name, "namespace": self.ns, "labels": {SECRET_LABEL: "true"} if labeled else {}}
        self.emu.create({"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "data": encoded})

    def base_manifest(self, name: str = "demo", replicas: int = 2, endpoint: str | None = None) -> dict:
        return {
            "apiVersion": API,
            "kind": "LoRABase",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "model": {"uri": "s3://models/tiny/", "sha256": self.base_hash},
                "replicas": replicas,
                "engine": {"maxRank": self.max_rank},
                "storage": {"endpoint": endpoint or self.s3.url, "region": "us-east-1",
                            "credentialsSecretRef": {"name": "s3"}},
                "trust": {"publicKeysSecretRef": {"name": "signers"}},
                "adminTokenSecretRef": {"name": "admin-token"},
            },
        }  # fmt: skip

    def create_base(self, name: str = "demo", replicas: int = 2, endpoint: str | None = None) -> dict:
        return self.emu.create(self.base_manifest(name, replicas, endpoint))

    def adapter_manifest(self, name: str, uri: str, version: str, base: str = "demo", **spec) -> dict:
        return {
            "apiVersion": API,
            "kind": "LoRAAdapter",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {"baseRef": {"name": base}, "source": {"uri": uri}, "version": version, **spec},
        }

    def create_adapter(self, name: str, uri: str, version: str, base: str = "demo", **spec) -> dict:
        return self.emu.create(self.adapter_manifest(name, uri, version, base, **spec))

    def get(self, kind: str, name: str) -> dict:
        return self.emu.get(API if kind.startswith("LoRA") else "apps/v1", kind, name, self.ns)

    def adapter(self, name: str) -> dict:
        return self.emu.get(API, "LoRAAdapter", name, self.ns)

    def api(self, method: str, kind: str, name: str, body: dict | None = None) -> dict:
        """A real API call (counted in the emulator's log), for what a user or another writer does."""
        from loraplane.operator.kube import MERGE_PATCH, custom_ref

        kube = Kube(self.emu.api_client())
        path = custom_ref(kind.lower() + "s", self.ns, name).path()
        return kube._call(method, path, body, content_type=MERGE_PATCH if method == "PATCH" else None)

    def add_pod(self, base: str = "demo", ready: bool = True) -> FakePod:
        """A fake server pod: the Deployment's pod in the API, a FakePod at its IP."""
        deployment = wait_for(lambda: self.get("Deployment", base), what=f"Deployment {base}")
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": base,
                 "uid": deployment["metadata"]["uid"], "controller": True}  # fmt: skip
        fake = FakePod(f"127.0.0.{next(_ips)}", self.port, TOKEN, self.base_hash)
        name = f"{base}-{len(self.pods)}-{fake.ip.rsplit('.', 1)[1]}"
        containers = [
            {"name": "server", "image": "test", "ports": [{"name": "admin", "containerPort": self.port}]}
        ]
        self.emu.make_pod(name, B.labels(base), namespace=self.ns, ready=ready, ip=fake.ip, owner=owner,
                          containers=containers)  # fmt: skip
        self.pods[name] = fake
        return fake

    def remove_pod(self, name: str) -> None:
        self.emu.delete("v1", "Pod", name, self.ns)
        self.pods.pop(name).stop()

    def close(self) -> None:
        for fake in self.pods.values():
            fake.stop()

    def wait_adapter(self, name: str, check, timeout: float = 30.0, what: str = "") -> dict:
        seen = {}

        def probe():
            seen["last"] = adapter = self.adapter(name)
            return adapter if check(adapter) else None

        try:
            return wait_for(probe, timeout, what=what or f"LoRAAdapter {name}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; status: {seen.get('last', {}).get('status')}") from None

    def wait_ready(self, name: str, timeout: float = 30.0, version: str | None = None) -> dict:
        def ready(a):
            ok = condition(a, "Ready").get("status") == "True"
            gen = a["metadata"].get("generation") == (a.get("status") or {}).get("observedGeneration")
            return ok and gen and (version is None or a["status"].get("servingVersion") == version)

        return self.wait_adapter(name, ready, timeout, f"{name} Ready")

    def wait_reason(self, name: str, reason: str, type_: str = "Degraded", timeout: float = 30.0) -> dict:
        return self.wait_adapter(name, lambda a: condition(a, type_).get("reason") == reason, timeout,
                                 f"{name} {type_} reason {reason}")  # fmt: skip
