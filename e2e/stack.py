"""The whole stack for the scenarios: the real control plane, `helm install` of the chart, S3 with the tiny base
model and signed adapters, and the kubelet stand-in running every Pod as a real process (the operator's Pod
runs `loraplane operator run` with the chart's args and its ServiceAccount's token; each server Pod runs
`loraplane serve` with the operator's args on CPU, on its own 127.0.0.N).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.operator.policy import SECRET_LABEL
from tests.adapter_factory import build_signed_adapter, make_keys, push_adapter
from tests.chart.chart import CHART, ensure_tools
from tests.controlplane.kubelet import Kubelet
from tests.controlplane.processes import ProcessRuntime, container_log_tail

API = "loraplane.dev/v1alpha1"
RELEASE = "lp"
MODELS, ADAPTERS = "models", "adapters"
ADMIN_TOKEN = "e2e-admin-token-0123456789abcdef"


def wait_for(check, timeout: float, what: str, interval: float = 0.5):
    """Poll ``check()`` until truthy; the last value (or exception) explains a timeout."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - "not yet"
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}: last {last!r}")


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or () if c["type"] == type_), {})


POD_START = 480.0  # two torch processes starting on a 2-core machine that also runs the rest of the suite


def ensure_base(stack, replicas: int = 2) -> list[dict]:
    """The LoRABase `demo` applied (idempotent), and its Pods Ready."""
    stack.apply(stack.base_manifest(replicas=replicas))
    return wait_for(lambda: len(stack.ready_pods()) == replicas and stack.ready_pods(), POD_START,
                    f"{replicas} server Pods Ready\n{stack.logs()}")  # fmt: skip


def admin_list(pod: dict) -> dict:
    """GET /admin/adapters on a Pod, as the operator calls it (its IP, the admin port, the admin token)."""
    request = urllib.request.Request(f"http://{pod['status']['podIP']}:8001/admin/adapters")
    request.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)


def admin_get(pod: dict, path: str) -> bytes:
    """Any GET on a Pod's admin port (``path`` with its query), with the admin token."""
    request = urllib.request.Request(f"http://{pod['status']['podIP']}:8001{path}")
    request.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read()


@dataclass
class Stack:
    plane: object
    namespace: str
    workdir: Path
    s3: object
    keys: object
    base_hash: str
    model_dir: Path
    uris: dict[str, str] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    folders: dict[str, Path] = field(default_factory=dict)
    runtime: ProcessRuntime | None = None
    kubelet: Kubelet | None = None

    # --- set-up ------------------------------------------------------------------------------------
    def helm(self, *args: str) -> str:
        home = self.workdir / "helm-home"
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "KUBECONFIG": str(self.plane.kubeconfig_path),
        }
        result = subprocess.run([str(ensure_tools()["helm4"]), *args], env=env, capture_output=True, text=True,
                                timeout=180)  # fmt: skip
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def install_chart(self, *extra: str) -> str:
        return self.helm("install", RELEASE, str(CHART), "--namespace", self.namespace,
                         "--set", "operator.driftCheckIntervalSeconds=5",
                         "--set-json", f"operator.policy.allowedS3Endpoints={json.dumps([self.s3.url])}",
                         *extra)  # fmt: skip

    def secret(self, name: str, data: dict[str, str], labeled: bool = True) -> None:
        """A Secret; ``labeled``: carries the label that lets the operator use it."""
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        labels = {SECRET_LABEL: "true"} if labeled else {}
        self.plane.create({"apiVersion": "v1", "kind": "Secret", "data": encoded,
                           "metadata": {"name": name, "namespace": self.namespace, "labels": labels}})  # fmt: skip

    def start_kubelet(self) -> None:
        self.runtime = ProcessRuntime(self.plane, self.workdir / "pods")
        self.kubelet = Kubelet(self.plane, self.namespace, self.runtime).__enter__()

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.runtime is not None:
            self.runtime.stop_all()

    def add_adapter(self, label: str, name: str, version: str, *, signer=None, base_hash: str | None = None,
                    seed: int = 0) -> str:  # fmt: skip
        config = json.loads((self.model_dir / "config.json").read_text())
        adapter = build_signed_adapter(self.workdir / "adapters" / label, name=name, version=version,
                                       keys=signer or self.keys, base_hash=base_hash or self.base_hash,
                                       base_config=config, rank=4, seed=seed, scale=0.5)  # fmt: skip
        self.folders[label] = adapter.folder
        self.uris[label] = push_adapter(adapter.folder, self.s3.client(), ADAPTERS)
        self.digests[label] = adapter.digest
        return self.uris[label]

    # --- objects -------------------------------------------------------------------------------------
    def base_manifest(self, name: str = "demo", replicas: int = 2) -> dict:
        return {
            "apiVersion": API, "kind": "LoRABase",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {
                "model": {"uri": f"s3://{MODELS}/tiny/", "sha256": self.base_hash},
                "replicas": replicas,
                "engine": {"maxRank": 8, "dtype": "float32", "maxNumSeqs": 8},
                "storage": {"endpoint": self.s3.url, "region": "us-east-1", "credentialsSecretRef": {"name": "s3"}},
                "trust": {"publicKeysSecretRef": {"name": "signers"}},
                "adminTokenSecretRef": {"name": "admin-token"},
            },
        }  # fmt: skip

    def adapter_manifest(self, name: str, label: str, version: str, base: str = "demo") -> dict:
        return {"apiVersion": API, "kind": "LoRAAdapter", "metadata": {"name": name, "namespace": self.namespace},
                "spec": {"baseRef": {"name": base}, "source": {"uri": self.uris[label]}, "version": version}}  # fmt: skip

    def apply(self, *docs: dict) -> str:
        text = "\n---\n".join(json.dumps(d) for d in docs)
        return self.plane.kubectl("apply", "-f", "-", input=text).stdout

    def get(self, kind: str, name: str) -> dict:
        return self.plane.get(API if kind.startswith("LoRA") else "apps/v1", kind, name, self.namespace)

    def server_pods(self, base: str = "demo") -> list[dict]:
        return [p for p in self.plane.list("v1", "Pod", self.namespace)
                if p["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == base]  # fmt: skip

    def ready_pods(self, base: str = "demo") -> list[dict]:
        return [p for p in self.server_pods(base) if condition(p, "Ready").get("status") == "True"]

    def logs(self) -> str:
        """The tail of every Pod's log: what a failed scenario needs to show."""
        if self.runtime is None:
            return ""
        errors = self.kubelet.errors[-3:] if self.kubelet is not None else []
        return "\n".join([f"--- kubelet errors: {errors}"] + [f"--- {c.log}\n{container_log_tail(c, 1500)}"
                                                               for c in self.runtime.started])  # fmt: skip

    def admin_calls(self, method: str, name: str = "") -> int:
        """Admin API calls of ``method`` on adapter ``name`` that the server Pods (not the operator's) logged: their
        access lines, in uvicorn's text or the server's own (text or JSON) format."""
        if self.runtime is None:
            return 0
        verb, path = re.compile(rf"\b{method}\b"), f"/admin/adapters/{name}"
        servers = [
            c.log
            for c in self.runtime.started
            if c.log.exists() and not c.log.parent.name.startswith(RELEASE)
        ]
        lines = (line for log in servers for line in log.read_text(errors="replace").splitlines())
        return sum(1 for line in lines if path in line and verb.search(line))


def build_stack(plane, namespace: str, workdir: Path, s3, model_dir: Path, base_hash: str) -> Stack:
    keys = make_keys(workdir / "keys")
    stack = Stack(plane, namespace, workdir, s3, keys, base_hash, model_dir)
    client = s3.client()
    for bucket in (MODELS, ADAPTERS):
        client.create_bucket(Bucket=bucket)
    for path in sorted(model_dir.iterdir()):
        client.upload_file(str(path), MODELS, f"tiny/{path.name}")
    stack.secret("admin-token", {"token": ADMIN_TOKEN})
    stack.secret("signers", {"release.pem": keys.public_pem.decode()})
    stack.secret("s3", {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key})
    stack.secret("unrelated", {"password": "not-for-the-operator"}, labeled=False)
    return stack
