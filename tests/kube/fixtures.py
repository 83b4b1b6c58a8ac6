"""Run the Kubernetes API emulator for a test, and the pod-side helpers no controller provides.

The emulator runs in its own thread with its own event loop. Sync clients (the ``kubernetes``
package, ``kubectl`` subprocesses) can call it from the test thread without blocking the loop that
serves them, and async code under test (kopf) runs in the test's loop as against a real cluster.

Fixtures: ``kube_emulator`` (function scope), ``kube_emulator_module`` (module scope; its store
persists across the module's tests, so use distinct namespaces or names).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import pathlib
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp.test_utils
import pytest

from tests.kube.emulator import KubeEmulator, LoggedRequest
from tests.kube.store import Store

KUBECTL = str(pathlib.Path(sys.executable).with_name("kubectl"))


class RunningEmulator:
    """A handle on an emulator serving on 127.0.0.1 from a background thread."""

    def __init__(self, workdir: pathlib.Path, bookmark_interval: float = 5.0) -> None:
        self.workdir = workdir
        self.store = Store()
        self.emulator: KubeEmulator | None = None
        self._bookmark_interval = bookmark_interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self.url = ""
        self.kubeconfig_path = workdir / "kubeconfig"

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> RunningEmulator:
        self._thread.start()
        if not self._ready.wait(timeout=30) or self._failure is not None:
            raise RuntimeError(f"the Kubernetes emulator did not start: {self._failure!r}")
        self._write_kubeconfig()
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # surfaced by start()
            self._failure = e
            self._ready.set()

    async def _serve(self) -> None:
        # kmock.Server would also patch aiohttp's resolver process-wide, which collides with other
        # loops in other threads; serving the KMock handler with aiohttp's RawTestServer avoids that.
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.emulator = KubeEmulator(store=self.store, bookmark_interval=self._bookmark_interval)
        async with self.emulator:
            server = aiohttp.test_utils.RawTestServer(self.emulator, host="127.0.0.1", port=None)
            await server.start_server()
            try:
                self.url = str(server.make_url("")).rstrip("/")
                self._ready.set()
                await self._stop.wait()
                self.emulator.close_watches()
                await asyncio.sleep(0.6)  # let watch streams notice and finish cleanly
            finally:
                await server.close()

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "dummy-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                          "namespace": "default"}}],
        }
        self.kubeconfig_path.write_text(json.dumps(config, indent=2))

    # --- clients -------------------------------------------------------------------------------

    @property
    def requests(self) -> list[LoggedRequest]:
        assert self.emulator is not None
        return self.emulator.log

    def api_client(self):
        """A ``kubernetes.client.ApiClient`` for this emulator, never reading $KUBECONFIG."""
        import kubernetes

        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(self.kubeconfig_path),
                                           client_configuration=configuration)
        return kubernetes.client.ApiClient(configuration)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the emulator (own discovery cache dir; $KUBECONFIG ignored)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        env["KUBECONFIG"] = str(self.kubeconfig_path)
        env["HOME"] = str(self.workdir)
        command = [KUBECTL, f"--cache-dir={self.workdir / 'kubectl-cache'}", *args]
        result = subprocess.run(command, capture_output=True, text=True, env=env, input=input, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    # --- direct store access (thread-safe; no HTTP, not counted in .requests) ------------------

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        rt = self.store.type_by_kind(obj["apiVersion"], obj["kind"])
        return self.store.create(rt, obj["metadata"].get("namespace", "default") if rt.namespaced else "", obj)

    def get(self, api_version: str, kind: str, name: str, namespace: str = "default") -> dict[str, Any]:
        rt = self.store.type_by_kind(api_version, kind)
        return self.store.get(rt, namespace if rt.namespaced else "", name)

    def set_status(self, api_version: str, kind: str, name: str, status: dict[str, Any],
                   namespace: str = "default") -> dict[str, Any]:
        rt = self.store.type_by_kind(api_version, kind)

        def change(obj: dict[str, Any]) -> dict[str, Any]:
            obj["status"] = copy.deepcopy(status)
            return obj

        return self.store.update(rt, namespace if rt.namespaced else "", name, change, "status")

    def delete(self, api_version: str, kind: str, name: str, namespace: str = "default") -> dict[str, Any]:
        rt = self.store.type_by_kind(api_version, kind)
        return self.store.delete(rt, namespace if rt.namespaced else "", name)

    def make_pod(self, name: str, labels: dict[str, str] | None = None, *, namespace: str = "default",
                 ready: bool = True, ip: str = "127.0.0.1", port: int | None = None,
                 owner: dict[str, Any] | None = None, containers: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
        """Create a Running pod (status written through /status, as a kubelet would)."""
        pod = pod_manifest(name, labels or {}, namespace=namespace, port=port, owner=owner, containers=containers)
        self.create(pod)
        return self.set_status("v1", "Pod", name, pod_status(ready, ip), namespace)

    def set_pod_ready(self, name: str, ready: bool, namespace: str = "default") -> dict[str, Any]:
        pod = self.get("v1", "Pod", name, namespace)
        return self.set_status("v1", "Pod", name, pod_status(ready, pod["status"].get("podIP", "")), namespace)

    def create_pods_for_deployment(self, name: str, namespace: str = "default", *, ip: str = "127.0.0.1",
                                   port: int | None = None, ready: bool = True,
                                   replicas: int | None = None) -> list[dict[str, Any]]:
        """Play the Deployment and ReplicaSet controllers once: create the missing pods and status.

        Pods get the template's labels, an ownerReference to the Deployment (so they cascade),
        ``status.podIP = ip`` and, when ``port`` is given, that port as every container's first
        containerPort (point it at a test HTTP server). Returns all the Deployment's pods.
        """
        deployment = self.get("apps/v1", "Deployment", name, namespace)
        want = deployment["spec"].get("replicas", 1) if replicas is None else replicas
        template = deployment["spec"]["template"]
        labels = dict((template.get("metadata") or {}).get("labels") or {})
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": deployment["metadata"]["uid"],
                 "controller": True, "blockOwnerDeletion": True}
        template_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        labels["pod-template-hash"] = template_hash
        existing = self._owned_pods(deployment["metadata"]["uid"], namespace)
        for _ in range(len(existing), want):
            containers = copy.deepcopy(template["spec"]["containers"])
            self.make_pod(f"{name}-{template_hash}-{secrets.token_hex(3)[:5]}", labels, namespace=namespace,
                          ready=ready, ip=ip, port=port, owner=owner, containers=containers)
        pods = self._owned_pods(deployment["metadata"]["uid"], namespace)
        ready_count = sum(_is_ready(p) for p in pods)
        self.set_status("apps/v1", "Deployment", name, {
            "observedGeneration": deployment["metadata"]["generation"], "replicas": len(pods),
            "updatedReplicas": len(pods), "readyReplicas": ready_count, "availableReplicas": ready_count,
        }, namespace)
        return pods

    def _owned_pods(self, owner_uid: str, namespace: str) -> list[dict[str, Any]]:
        rt = self.store.type_by_kind("v1", "Pod")

        def owned(pod: dict[str, Any]) -> bool:
            return any(r.get("uid") == owner_uid for r in pod["metadata"].get("ownerReferences") or [])

        pods, _ = self.store.list(rt, namespace, owned)
        return pods


def pod_manifest(name: str, labels: dict[str, str], *, namespace: str = "default", port: int | None = None,
                 owner: dict[str, Any] | None = None, containers: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    containers = containers or [{"name": "main", "image": "loraplane/test:latest"}]
    if port is not None:
        for container in containers:
            ports = [p for p in container.get("ports") or [] if p.get("containerPort") != port]
            container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}] + \
                [p for p in ports if p.get("name") != "http"]
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": containers}}


def pod_status(ready: bool, ip: str) -> dict[str, Any]:
    from tests.kube.store import now_rfc3339

    stamp, flag = now_rfc3339(), "True" if ready else "False"
    conditions = [{"type": t, "status": "True", "lastTransitionTime": stamp} for t in ("PodScheduled", "Initialized")]
    conditions += [{"type": t, "status": flag, "lastTransitionTime": stamp} for t in ("ContainersReady", "Ready")]
    return {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": stamp,
            "conditions": conditions}


def _is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@pytest.fixture
def kube_emulator(tmp_path: pathlib.Path) -> Iterator[RunningEmulator]:
    running = RunningEmulator(tmp_path, bookmark_interval=1.0).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def kube_emulator_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEmulator]:
    running = RunningEmulator(tmp_path_factory.mktemp("kube"), bookmark_interval=1.0).start()
    try:
        yield running
    finally:
        running.stop()
