"""Run the Kubernetes API emulator for a test, and the pod-side helpers no controller provides.

The emulator runs in its own thread with its own event loop. Sync clients (the ``kubernetes``
package, ``kubectl`` subprocesses) can call it from the test thread without blocking the loop that
serves them, and async code under test (kopf) runs in the test's loop (or its own thread) as against
a real cluster. Nothing reads $KUBECONFIG: clients are built from ``kubeconfig_path`` explicitly.

Fixtures: ``kube_emulator`` (function scope), ``kube_emulator_module`` (module scope; its store
persists across the module's tests, so use distinct namespaces). Both yield a ``RunningEmulator``:

- ``RunningEmulator(workdir, bookmark_interval=5.0, port=0, schema_checks=True).start()`` / ``.stop()``
  for a hand-made one (the fixtures use a 1 s bookmark interval);
- ``.url``, ``.kubeconfig_path`` (token "dummy-token", context namespace "default"), ``.store``;
- ``.api_client()`` -> ``kubernetes.client.ApiClient``; ``.kubectl(*args, check=True, input=None)``;
- ``.requests`` (``LoggedRequest(method, path, query, content_type, body, status)``, ``.is_watch``),
  ``.count_requests(method=None, contains="", since=0, watch=None)``;
- ``.fail(method, path_regex, code=500, times=1, reason=..., message=...)``: inject API errors;
  ``.emulator`` is the KMock handler, for any other KMock DSL reaction;
- direct store access (thread-safe, not logged as requests): ``.create(obj)``,
  ``.get(api_version, kind, name, namespace)``, ``.set_status(api_version, kind, name, status, namespace)``,
  ``.delete(api_version, kind, name, namespace)``;
- pods: ``.make_pod(name, labels, namespace=, ready=, ip=, port=, owner=, containers=)``,
  ``.set_pod_ready(name, ready, namespace)``,
  ``.create_pods_for_deployment(name, namespace, ip=str|fn(index), port=, ready=, replicas=,
  replace_outdated=True)`` (plays the Deployment/ReplicaSet controllers once, status included).

kopf in the test's loop: ``async with tests.kube.operators.running_operator(kube, registry): ...``;
a hand-run server for kubectl sessions: ``.venv/bin/python tests/kube/serve.py --kubeconfig PATH``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp.test_utils
import pytest

from tests.kube.emulator import KubeEmulator, LoggedRequest
from tests.kube.errors import ApiError, now_rfc3339
from tests.kube.patching import clone
from tests.kube.store import Store, random_suffix

KUBECTL = str(pathlib.Path(sys.executable).with_name("kubectl"))


class RunningEmulator:
    """A handle on an emulator serving on 127.0.0.1 from a background thread."""

    def __init__(
        self, workdir: pathlib.Path, bookmark_interval: float = 5.0, port: int = 0, schema_checks: bool = True
    ) -> None:
        self.workdir = workdir
        self.store = Store(schema_checks=schema_checks)
        self.emulator: KubeEmulator | None = None
        self._bookmark_interval = bookmark_interval
        self._port = port or None
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
            server = aiohttp.test_utils.RawTestServer(self.emulator, host="127.0.0.1", port=self._port)
            await server.start_server()
            try:
                self.url = str(server.make_url("")).rstrip("/")
                self._ready.set()
                await self._stop.wait()
                self.emulator.close_watches()
                await asyncio.sleep(0.05)  # let watch streams finish cleanly
            finally:
                await server.close()

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "dummy-token"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "tester", "namespace": "default"},
                }
            ],
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
        kubernetes.config.load_kube_config(
            config_file=str(self.kubeconfig_path), client_configuration=configuration
        )
        return kubernetes.client.ApiClient(configuration)

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the emulator (own discovery cache dir; $KUBECONFIG ignored)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        env["KUBECONFIG"] = str(self.kubeconfig_path)
        env["HOME"] = str(self.workdir)
        command = [KUBECTL, f"--cache-dir={self.workdir / 'kubectl-cache'}", *args]
        result = subprocess.run(
            command, capture_output=True, text=True, env=env, input=input, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def count_requests(
        self, method: str | None = None, contains: str = "", *, since: int = 0, watch: bool | None = None
    ) -> int:
        """API calls after request index ``since`` (see ``len(.requests)``) by method and path fragment."""
        return sum(
            1
            for r in self.requests[since:]
            if (method is None or r.method == method.upper())
            and contains in r.path
            and (watch is None or r.is_watch == watch)
        )

    def fail(
        self,
        method: str,
        path_regex: str,
        code: int = 500,
        *,
        times: int | None = 1,
        reason: str = "InternalError",
        message: str = "injected by the test",
    ) -> None:
        """Answer the next ``times`` matching requests (None: all) with a Status error of ``code``.

        ``path_regex`` must match the whole path, e.g. ``r".*/loraadapters/a1(/status)?"``.
        Uses KMock's DSL, which the emulator consults before its own API logic.
        """
        assert self.emulator is not None
        view = self.emulator[method.lower(), re.compile(path_regex)]
        view = view if times is None else view[:times]
        view << ApiError(code, reason, message)  # noqa: B015  (KMock's DSL registers on <<)

    # --- direct store access (thread-safe; no HTTP, not counted in .requests) ------------------

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        rt = self.store.type_by_kind(obj["apiVersion"], obj["kind"])
        return self.store.create(
            rt, obj["metadata"].get("namespace", "default") if rt.namespaced else "", obj
        )

    def get(self, api_version: str, kind: str, name: str, namespace: str = "default") -> dict[str, Any]:
        rt = self.store.type_by_kind(api_version, kind)
        return self.store.get(rt, namespace if rt.namespaced else "", name)

    def set_status(
        self, api_version: str, kind: str, name: str, status: dict[str, Any], namespace: str = "default"
    ) -> dict[str, Any]:
        rt = self.store.type_by_kind(api_version, kind)

        def change(obj: dict[str, Any]) -> dict[str, Any]:
            obj["status"] = clone(status)
            return obj

        return self.store.update(rt, namespace if rt.namespaced else "", name, change, "status")

    def delete(self, api_version: str, kind: str, name: str, namespace: str = "default") -> dict[str, Any]:
        rt = self.store.type_by_kind(api_version, kind)
        return self.store.delete(rt, namespace if rt.namespaced else "", name)

    def make_pod(
        self,
        name: str,
        labels: dict[str, str] | None = None,
        *,
        namespace: str = "default",
        ready: bool = True,
        ip: str = "127.0.0.1",
        port: int | None = None,
        owner: dict[str, Any] | None = None,
        containers: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Create a Running pod (status written through /status, as a kubelet would)."""
        pod = pod_manifest(
            name, labels or {}, namespace=namespace, port=port, owner=owner, containers=containers
        )
        self.create(pod)
        return self.set_status("v1", "Pod", name, pod_status(ready, ip), namespace)

    def set_pod_ready(self, name: str, ready: bool, namespace: str = "default") -> dict[str, Any]:
        pod = self.get("v1", "Pod", name, namespace)
        return self.set_status(
            "v1", "Pod", name, pod_status(ready, pod["status"].get("podIP", "")), namespace
        )

    def create_pods_for_deployment(
        self,
        name: str,
        namespace: str = "default",
        *,
        ip: str | Callable[[int], str] = "127.0.0.1",
        port: int | None = None,
        ready: bool = True,
        replicas: int | None = None,
        replace_outdated: bool = True,
    ) -> list[dict[str, Any]]:
        """Play the Deployment and ReplicaSet controllers once: converge the pods and the status.

        Pods of the current template (label ``pod-template-hash``) are created up to ``replicas``
        (default: the Deployment's) or deleted down to it; pods of an older template are deleted
        (a finished rollout) unless ``replace_outdated`` is False. New pods get the template's
        labels, an ownerReference to the Deployment (so they cascade), ``status.podIP`` = ``ip``
        (or ``ip(index)``) and, when ``port`` is given, that port as every container's first
        containerPort (point it at a test HTTP server). Returns the current template's pods.
        """
        deployment = self.get("apps/v1", "Deployment", name, namespace)
        uid = deployment["metadata"]["uid"]
        want = deployment["spec"].get("replicas", 1) if replicas is None else replicas
        template = deployment["spec"]["template"]
        template_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        labels = dict(
            (template.get("metadata") or {}).get("labels") or {}, **{"pod-template-hash": template_hash}
        )
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": uid, "controller": True,
                 "blockOwnerDeletion": True}  # fmt: skip
        owned = self._owned_pods(uid, namespace)
        current = [
            p for p in owned if p["metadata"].get("labels", {}).get("pod-template-hash") == template_hash
        ]
        doomed = current[want:] + ([p for p in owned if p not in current] if replace_outdated else [])
        for pod in doomed:
            self.delete("v1", "Pod", pod["metadata"]["name"], namespace)
        for index in range(len(current), want):
            pod_ip = ip(index) if callable(ip) else ip
            self.make_pod(f"{name}-{template_hash}-{random_suffix()}", labels, namespace=namespace,
                          ready=ready, ip=pod_ip, port=port, owner=owner,
                          containers=clone(template["spec"]["containers"]))  # fmt: skip
        pods = [p for p in self._owned_pods(uid, namespace)
                if p["metadata"]["labels"].get("pod-template-hash") == template_hash]  # fmt: skip
        all_pods = self._owned_pods(uid, namespace)
        ready_count = sum(_is_ready(p) for p in all_pods)
        status = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": len(all_pods),
            "updatedReplicas": len(pods),
            "readyReplicas": ready_count,
            "availableReplicas": ready_count,
        }
        self.set_status("apps/v1", "Deployment", name, status, namespace)  # fmt: skip
        return pods

    def _owned_pods(self, owner_uid: str, namespace: str) -> list[dict[str, Any]]:
        rt = self.store.type_by_kind("v1", "Pod")

        def owned(pod: dict[str, Any]) -> bool:
            return any(r.get("uid") == owner_uid for r in pod["metadata"].get("ownerReferences") or [])

        pods, _ = self.store.list(rt, namespace, owned)
        return pods


def pod_manifest(
    name: str,
    labels: dict[str, str],
    *,
    namespace: str = "default",
    port: int | None = None,
    owner: dict[str, Any] | None = None,
    containers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    containers = containers or [{"name": "main", "image": "loraplane/test:latest"}]
    if port is not None:
        for container in containers:
            ports = [p for p in container.get("ports") or [] if p.get("containerPort") != port]
            container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}] + [
                p for p in ports if p.get("name") != "http"
            ]
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": containers}}


def pod_status(ready: bool, ip: str) -> dict[str, Any]:
    stamp, flag = now_rfc3339(), "True" if ready else "False"
    conditions = [
        {"type": t, "status": "True", "lastTransitionTime": stamp} for t in ("PodScheduled", "Initialized")
    ]
    conditions += [
        {"type": t, "status": flag, "lastTransitionTime": stamp} for t in ("ContainersReady", "Ready")
    ]
    return {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": "127.0.0.1",
        "startTime": stamp,
        "conditions": conditions,
    }


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
