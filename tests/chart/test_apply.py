"""`helm template | kubectl apply -f -` against the Kubernetes API emulator (helm install cannot target it:
Helm stores its release Secret as protobuf), then `kubectl get` shows what the chart created.

LORAPLANE_WRITE_TRANSCRIPTS=1 also writes the session to docs/transcripts/chart-apply.txt.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.chart.chart import CHART, CI_VALUES, NAMESPACE, RELEASE, REPO_ROOT, load_docs

TRANSCRIPT = REPO_ROOT / "docs" / "transcripts" / "chart-apply.txt"
SERVICE_MONITOR_CRD = REPO_ROOT / "tests" / "chart" / "fixtures" / "servicemonitor-crd.yaml"


class Session:
    """Runs commands the way a user types them, and keeps a transcript."""

    def __init__(self, emulator, helm_bin):
        self.emulator, self.helm_bin, self.lines = emulator, helm_bin, []

    def kubectl(self, *args: str, input: str | None = None, shown: str | None = None) -> str:
        result = self.emulator.kubectl(*args, input=input)
        self._record(shown or "kubectl " + " ".join(args), result.stdout + result.stderr)
        return result.stdout

    def helm(self, name: str, binary, *args: str) -> str:
        result = subprocess.run(
            [str(binary), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        self._record(f"{name} {' '.join(args)}", result.stdout + result.stderr)
        return result.stdout

    def helm_template(self, *args: str) -> str:
        command = [str(self.helm_bin), "template", RELEASE, str(CHART.relative_to(REPO_ROOT)), *args]
        result = subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120
        )
        return result.stdout

    def _record(self, command: str, output: str) -> None:
        self.lines += [f"$ {command}", output.rstrip(), ""]


def install(session: Session, values: list[str]) -> tuple[str, str]:
    """Namespace, then CRDs (as helm does: a CR in the same apply would race their registration), then
    the rendered templates. Returns (kubectl apply output, rendered manifests)."""
    chart_rel = CHART.relative_to(REPO_ROOT)
    # `kubectl create namespace` sends protobuf, which the emulator does not speak; apply sends JSON.
    namespace = session.emulator.kubectl("create", "namespace", NAMESPACE, "--dry-run=client", "-o", "yaml")
    shown = f"kubectl create namespace {NAMESPACE} --dry-run=client -o yaml | kubectl apply -f -"
    session.kubectl("apply", "-f", "-", input=namespace.stdout, shown=shown)
    session.kubectl("apply", "-f", str(CHART / "crds"), shown=f"kubectl apply -f {chart_rel}/crds/")
    rendered = session.helm_template("--namespace", NAMESPACE, *values)
    template = " ".join(["helm template", RELEASE, str(chart_rel), "--namespace", NAMESPACE, *values])
    applied = session.kubectl("apply", "-f", "-", input=rendered, shown=f"{template} | kubectl apply -f -")
    return applied, rendered


def test_default_values_apply(kube_emulator, helm_bins):
    session = Session(kube_emulator, helm_bins["helm4"])
    applied, rendered = install(session, [])
    for doc in load_docs(rendered):
        assert (
            f"{doc['kind'].lower()}" in applied.lower() and f"/{doc['metadata']['name']} created" in applied
        )
    out = session.kubectl("get", "deployments,serviceaccounts,services,roles,rolebindings", "-n", NAMESPACE)
    assert f"{RELEASE}-loraplane" in out and f"{RELEASE}-loraplane-metrics" in out
    crds = session.kubectl("get", "crd")
    assert "lorabases.loraplane.dev" in crds and "loraadapters.loraplane.dev" in crds


def test_ci_values_apply_with_examples(kube_emulator, helm_bins):
    session = Session(kube_emulator, helm_bins["helm4"])
    ci_rel = str(CI_VALUES.relative_to(REPO_ROOT))
    chart_rel = str(CHART.relative_to(REPO_ROOT))
    for key, shown in (("helm4", "helm"), ("helm3", "helm3")):  # .tools/bin/helm is v4, helm3 is v3
        session.helm(shown, helm_bins[key], "version", "--short")
        session.helm(shown, helm_bins[key], "lint", "--strict", chart_rel, "--values", ci_rel)
    session.kubectl(
        "apply", "-f", str(SERVICE_MONITOR_CRD),
        shown=f"kubectl apply -f {SERVICE_MONITOR_CRD.relative_to(REPO_ROOT)}  # stands in for the Prometheus Operator",
    )  # fmt: skip
    applied, rendered = install(session, ["--values", ci_rel])
    assert "clusterrole.rbac.authorization.k8s.io/lp-loraplane created" in applied
    assert "servicemonitor.monitoring.coreos.com/lp-loraplane created" in applied
    assert "lorabase.loraplane.dev/demo-base created" in applied
    out = session.kubectl(
        "get", "deployments,serviceaccounts,services,servicemonitors,lorabases", "-n", NAMESPACE
    )
    assert "deployment.apps/lp-loraplane" in out and "lorabase.loraplane.dev/demo-base" in out
    out = session.kubectl(
        "get", "clusterroles,clusterrolebindings", "-l", f"app.kubernetes.io/instance={RELEASE}"
    )
    assert "clusterrole.rbac.authorization.k8s.io/lp-loraplane" in out
    # The next step NOTES.txt gives: a LoRABase, then a LoRAAdapter (the operator watches all namespaces here).
    examples = sorted(p.name for p in (REPO_ROOT / "examples").glob("*.yaml"))
    if examples:
        session.kubectl("apply", "-f", str(REPO_ROOT / "examples"), shown="kubectl apply -f examples/")
        out = session.kubectl("get", "lorabases,loraadapters", "-A")
        assert "lorabase" in out.lower() and "loraadapter" in out.lower()
    path = "jsonpath={.spec.template.spec.containers[0].securityContext}"
    security = session.kubectl("get", "deployment", "lp-loraplane", "-n", NAMESPACE, "-o", path)
    assert '"runAsNonRoot":true' in security and '"readOnlyRootFilesystem":true' in security
    if os.environ.get("LORAPLANE_WRITE_TRANSCRIPTS") == "1":
        header = [
            "# helm template | kubectl apply against the Kubernetes API emulator (tests/kube), with helm v4.3.1",
            "# and kubectl 1.37. Written by LORAPLANE_WRITE_TRANSCRIPTS=1 .venv/bin/python -m pytest "
            "tests/chart/test_apply.py",
            "",
        ]
        TRANSCRIPT.parent.mkdir(parents=True, exist_ok=True)
        TRANSCRIPT.write_text("\n".join(header + session.lines))


@pytest.mark.parametrize("kind", ["Role", "ClusterRole"])
def test_rbac_objects_round_trip(kube_emulator, helm_bins, kind):
    """What the emulator stored is what the chart rendered: no field lost (apply is client-side)."""
    session = Session(kube_emulator, helm_bins["helm4"])
    values = ["--values", str(CI_VALUES.relative_to(REPO_ROOT))] if kind == "ClusterRole" else []
    session.kubectl("apply", "-f", str(SERVICE_MONITOR_CRD))
    _applied, rendered = install(session, values)
    want = next(doc for doc in load_docs(rendered) if doc["kind"] == kind)
    args = ["get", kind.lower(), want["metadata"]["name"], "-o", "yaml"]
    args += ["-n", NAMESPACE] if kind == "Role" else []
    stored = load_docs(session.kubectl(*args))[0]
    assert stored["rules"] == want["rules"]
