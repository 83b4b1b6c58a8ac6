"""helm 3 and 4 against the emulator: server-side apply, protobuf release Secrets, upgrade, uninstall."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from tests.kube.samples import widget_crd

TOOLS = (
    pathlib.Path(__file__).resolve().parents[2] / ".tools" / "bin"
)  # scripts/fetch_tools.py puts helm here

CHART = {
    "Chart.yaml": "apiVersion: v2\nname: demo\nversion: 0.1.0\n",
    "values.yaml": "replicas: 1\ngreeting: hello\n",
    "templates/config.yaml": """apiVersion: v1
kind: ConfigMap
metadata: {name: "{{ .Release.Name }}-config"}
data: {greeting: "{{ .Values.greeting }}"}
""",
    "templates/deployment.yaml": """apiVersion: apps/v1
kind: Deployment
metadata: {name: "{{ .Release.Name }}-web"}
spec:
  replicas: {{ .Values.replicas }}
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: web, image: "web:1"}]}
""",
    "templates/widget.yaml": """apiVersion: example.dev/v1
kind: Widget
metadata: {name: "{{ .Release.Name }}-widget"}
spec: {size: 1}
""",
}


@pytest.fixture
def chart(tmp_path) -> pathlib.Path:
    root = tmp_path / "demo"
    for name, text in CHART.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "crds").mkdir()
    (root / "crds" / "widgets.json").write_text(json.dumps(widget_crd()))
    return root


@pytest.mark.parametrize("binary", ["helm", "helm3"])
def test_helm_install_upgrade_uninstall(kube_emulator, chart, binary):
    helm_path = TOOLS / binary
    if not helm_path.exists():
        pytest.skip(f"{helm_path} is missing (scripts/fetch_tools.py extracts it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "HELM"))}
    env |= {"KUBECONFIG": str(kube_emulator.kubeconfig_path), "HOME": str(kube_emulator.workdir)}

    def helm(*args: str) -> str:
        result = subprocess.run(
            [str(helm_path), *args, "-n", "default"], capture_output=True, text=True, env=env
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    helm("install", "demo", str(chart))
    assert "deployed" in helm("status", "demo")
    helm("upgrade", "demo", str(chart), "--set", "greeting=bonjour,replicas=2")
    config = kube_emulator.get("v1", "ConfigMap", "demo-config")
    assert config["data"] == {"greeting": "bonjour"}
    assert kube_emulator.get("apps/v1", "Deployment", "demo-web")["spec"]["replicas"] == 2
    releases = kube_emulator.kubectl("get", "secrets", "-l", "owner=helm", "-o", "name").stdout.split()
    assert releases == ["secret/sh.helm.release.v1.demo.v1", "secret/sh.helm.release.v1.demo.v2"]

    helm("uninstall", "demo", "--wait")
    left = kube_emulator.kubectl("get", "configmaps,deployments,widgets,secrets", "-o", "name").stdout.split()
    assert left == []  # helm keeps crds/ but deletes everything it templated, and its release Secrets
