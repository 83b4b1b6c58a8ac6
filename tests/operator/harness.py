"""Run the real operator (kopf + the kubernetes client) against the real API server, in a thread of its own.

``OperatorThread`` uses kopf's ``spawn_tasks`` + ``run_tasks`` in its own event loop, so the test thread stays
synchronous. It talks to the API server as the chart's ServiceAccount (a TokenRequest token), with the chart's
own Role, so every test also checks the chart's RBAC. ``World`` sets up one namespace: that RBAC, Secrets, a
LoRABase whose pods the kubelet stand-in runs as fake admin servers, and helpers to create adapters and wait.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import threading
import time
from typing import Any

import kopf

from loraplane.operator import builders as B
from loraplane.operator import handlers
from loraplane.operator.context import Context, Tunables
from loraplane.operator.kube import Kube
from loraplane.operator.policy import SECRET_LABEL, OperatorPolicy
from tests.controlplane.kubelet import MERGE_PATCH, Kubelet
from tests.operator.fake_admin import FakePod

API = "loraplane.dev/v1alpha1"
TOKEN = "test-admin-token"
# The S3 endpoints the test Worlds use (their moto server, and a port where nothing listens): the
# operator's default policy in these tests allows exactly these.
TEST_ENDPOINTS: set[str] = {"http://127.0.0.1:9"}


def fast_tunables(**overrides) -> Tunables:
    values = dict(drift_interval=1.0, poll_interval=0.3, retry_delay=0.5, max_retry_delay=2.0,
                  admin_connect_timeout=0.5, admin_read_timeout=1.5, s3_attempts=1)  # fmt: skip
    values.update(overrides)
    return Tunables(**values)


class OperatorThread:
    """The operator, in a thread, authenticated as the chart's ServiceAccount of ``world``'s namespace."""

    def __init__(self, world: World, tunables: Tunables | None = None, policy: OperatorPolicy | None = None):
        policy = policy or OperatorPolicy(  # the chart's default placement: the GPU taint and node labels
            allowed_s3_endpoints=tuple(sorted(TEST_ENDPOINTS)),
            allowed_tolerations=("nvidia.com/gpu",),
            allowed_node_labels=("nvidia.com/gpu.present", "nvidia.com/gpu.product"),
        )
        kube = Kube(world.plane.api_client(token=world.operator_token()))
        self.ctx = Context(kube, tunables or fast_tunables(), policy=policy)
        self.namespace = world.ns
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"operator-{self.namespace}", daemon=True)

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


class FakeContainer:
    """What the kubelet stand-in runs for one Pod: a FakePod on the Pod's IP and declared admin port.

    Readiness is what the test says (``ready``), not whether the fake server answers: stopping a FakePod plays
    a pod that Kubernetes still calls Ready but the operator cannot reach.
    """

    def __init__(self, pod: dict, ip: str, token: str, base_hash: str):
        ports = [
            p for c in pod["spec"]["containers"] for p in c.get("ports") or () if p.get("name") == "admin"
        ]
        self.fake = FakePod(ip, ports[0]["containerPort"] if ports else B.ADMIN_PORT, token, base_hash)
        self.name = pod["metadata"]["name"]
        self.is_ready = True

    def ready(self) -> bool:
        return self.is_ready

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        self.fake.stop()


def render_operator_rbac(namespace: str) -> list[dict]:
    """The chart's ServiceAccount, Role and RoleBinding for a release in ``namespace`` (helm template)."""
    from tests.chart.chart import CHART, ensure_tools, load_docs

    helm = ensure_tools()["helm4"]
    out = subprocess.run(
        [str(helm), "template", "lp", str(CHART), "--namespace", namespace,
         "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return load_docs(out.stdout)


def wait_until_rbac_applies(plane, namespace: str, token: str) -> None:
    """Block until ``token`` may list LoRABases in ``namespace``: the API server's RBAC cache takes a new Role
    a moment after it is created, and an operator started before then begins in kopf's 403 backoff."""
    path = plane.path("loraplane.dev/v1alpha1", "LoRABase", "", namespace)
    wait_for(lambda: plane.request("GET", path, token=token)[0] == 200, timeout=30, what="the Role to apply")


class World:
    """One namespace with the chart's RBAC and a LoRABase ``demo`` whose Pods run fake admin servers."""

    def __init__(self, plane, namespace: str, *, s3, keys, base_hash: str, max_rank: int = 16):
        self.plane, self.ns, self.s3, self.keys, self.base_hash = plane, namespace, s3, keys, base_hash
        self.max_rank = max_rank
        self.pods: dict[str, FakePod] = {}  # pod name -> fake server
        self.new_pod_fail: str | None = None  # FakePod.fail of the next Pods the kubelet starts
        TEST_ENDPOINTS.add(s3.url)
        rbac = render_operator_rbac(namespace)
        for doc in rbac:
            plane.create(doc)
        self.service_account = next(d for d in rbac if d["kind"] == "ServiceAccount")
        wait_until_rbac_applies(plane, namespace, self.operator_token())
        self.secret("admin-token", {"token": TOKEN})
        self.secret("signers", {"release.pem": keys.public_pem.decode()})
        self.secret("s3", {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key})
        self.kubelet = Kubelet(plane, namespace, self._container, admit_all=False).__enter__()

    @property
    def emu(self):
        """The API server, under the name older tests use."""
        return self.plane

    @property
    def operator_user(self) -> str:
        return f"system:serviceaccount:{self.ns}:{self.service_account['metadata']['name']}"

    def operator_token(self) -> str:
        return self.plane.service_account_token(self.ns, self.service_account["metadata"]["name"])

    def _container(self, pod: dict, ip: str) -> FakeContainer:
        container = FakeContainer(pod, ip, TOKEN, self.base_hash)
        container.fake.fail = self.new_pod_fail
        self.pods[container.name] = container.fake
        return container

    def secret(self, name: str, data: dict[str, str], labeled: bool = True) -> None:
        """A Secret; ``labeled``: carries the label that lets the operator use it."""
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        metadata = {"name": name, "namespace": self.ns, "labels": {SECRET_LABEL: "true"} if labeled else {}}
        self.plane.create({"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "data": encoded})

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
        return self.plane.create(self.base_manifest(name, replicas, endpoint))

    def adapter_manifest(self, name: str, uri: str, version: str, base: str = "demo", **spec) -> dict:
        return {
            "apiVersion": API,
            "kind": "LoRAAdapter",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {"baseRef": {"name": base}, "source": {"uri": uri}, "version": version, **spec},
        }

    def create_adapter(self, name: str, uri: str, version: str, base: str = "demo", **spec) -> dict:
        return self.plane.create(self.adapter_manifest(name, uri, version, base, **spec))

    def get(self, kind: str, name: str) -> dict:
        return self.plane.get(API if kind.startswith("LoRA") else "apps/v1", kind, name, self.ns)

    def adapter(self, name: str) -> dict:
        return self.plane.get(API, "LoRAAdapter", name, self.ns)

    def events(self, reason: str | None = None) -> list[dict]:
        return [
            e for e in self.plane.list("v1", "Event", self.ns) if reason is None or e.get("reason") == reason
        ]

    def api(self, method: str, kind: str, name: str, body: dict | None = None) -> dict:
        """A call as the admin, for what a user or another writer does."""
        path = self.plane.path(API, kind, name, self.ns)
        status, answer = self.plane.request(method, path, body, content_type=MERGE_PATCH)
        if status >= 300:
            raise RuntimeError(f"{method} {kind} {name}: {status} {answer[:300]!r}")
        return json.loads(answer)

    def add_pod(self, base: str = "demo") -> FakePod:
        """Let the next pending Pod of the base's Deployment start; its fake server once it runs."""
        before = set(self.kubelet.running)
        self.kubelet.admit(1)

        def started():
            return [n for n in self.kubelet.running if n not in before]

        name = wait_for(started, timeout=60, what=f"a new Pod of {base} running")[0]
        return self.pods[name]

    def remove_pod(self, name: str) -> None:
        """The Pod is evicted and its server stops; the ReplicaSet makes a new one (Pending until admitted)."""
        self.kubelet.kill(name)
        self.pods.pop(name)

    def close(self) -> None:
        self.kubelet.stop()

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
