"""`helm install`, `upgrade` and `uninstall` of the chart against the real API server, with helm 4 and helm 3.

Helm stores its release as a protobuf-encoded Secret and (helm 4) applies server-side: only a real server
shows that the chart installs. LORAPLANE_WRITE_TRANSCRIPTS=1 also writes docs/transcripts/chart-apply.txt.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.chart.chart import CHART, CI_VALUES, REPO_ROOT, load_docs
from tests.controlplane.fixtures import create_namespace

TRANSCRIPT = REPO_ROOT / "docs" / "transcripts" / "chart-apply.txt"
SERVICE_MONITOR_CRD = REPO_ROOT / "tests" / "chart" / "fixtures" / "servicemonitor-crd.yaml"


class Session:
    """Runs helm and kubectl the way a user types them, as the cluster admin, and keeps a transcript."""

    def __init__(self, plane, helm_bin, shown_helm: str = "helm"):
        self.plane, self.helm_bin, self.shown_helm, self.lines = plane, helm_bin, shown_helm, []

    def kubectl(self, *args: str, input: str | None = None, shown: str | None = None) -> str:
        result = self.plane.kubectl(*args, input=input)
        self._record(shown or "kubectl " + " ".join(args), result.stdout + result.stderr)
        return result.stdout

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        home = self.plane.workdir / "helm-home"
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "KUBECONFIG": str(self.plane.kubeconfig_path),
               "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
               "HELM_DATA_HOME": str(home / "data")}  # fmt: skip
        result = subprocess.run([str(self.helm_bin), *args], cwd=REPO_ROOT, env=env, capture_output=True,
                                text=True, timeout=180)  # fmt: skip
        if check:
            assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        self._record(f"{self.shown_helm} {' '.join(args)}", result.stdout + result.stderr)
        return result

    def _record(self, command: str, output: str) -> None:
        self.lines += [f"$ {command}", output.rstrip(), ""]


def rendered(session: Session, release: str, namespace: str, *values: str) -> list[dict]:
    out = session.helm(
        "template", release, str(CHART.relative_to(REPO_ROOT)), "--namespace", namespace, *values
    )
    return load_docs(out.stdout)


@pytest.mark.parametrize(
    "helm_name", ["helm4", "helm3"]
)  # helm 4 first: it installs the CRDs, helm 3 finds them
def test_install_upgrade_uninstall(bare_cluster, helm_bins, helm_name):
    control_plane, namespace = bare_cluster, create_namespace(bare_cluster)
    session = Session(control_plane, helm_bins[helm_name], helm_name)
    release, chart = f"lp-{helm_name}", str(CHART.relative_to(REPO_ROOT))
    session.helm("install", release, chart, "--namespace", namespace)
    crds = control_plane.kubectl("get", "crd", "-o", "name").stdout
    assert "loraadapters.loraplane.dev" in crds and "lorabases.loraplane.dev" in crds
    status = json.loads(session.helm("status", release, "--namespace", namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed" and status["version"] == 1
    want = {(d["kind"], d["metadata"]["name"]) for d in rendered(session, release, namespace)}
    got = set()
    for kind, name in want:
        got.add((kind, control_plane.get(api_version(kind), kind, name, namespace)["metadata"]["name"]))
    assert got == want
    role = next(d for d in rendered(session, release, namespace) if d["kind"] == "Role")
    assert control_plane.get("rbac.authorization.k8s.io/v1", "Role", role["metadata"]["name"], namespace)[
        "rules"] == role["rules"], "the server stored every rule the chart rendered"  # fmt: skip
    deployment = f"{release}-loraplane"
    session.helm("upgrade", release, chart, "--namespace", namespace, "--set", "operator.logLevel=debug")
    args = control_plane.get("apps/v1", "Deployment", deployment, namespace)["spec"]["template"]["spec"][
        "containers"][0]["args"]  # fmt: skip
    assert "--verbose" in args, args  # what logLevel=debug turns on
    session.helm("uninstall", release, "--namespace", namespace)
    for kind, name in want:
        with pytest.raises(LookupError):
            control_plane.get(api_version(kind), kind, name, namespace)
    crds = control_plane.kubectl("get", "crd").stdout
    assert "loraadapters.loraplane.dev" in crds, "helm never deletes CRDs"


def api_version(kind: str) -> str:
    return {"Deployment": "apps/v1", "Role": "rbac.authorization.k8s.io/v1",
            "RoleBinding": "rbac.authorization.k8s.io/v1"}.get(kind, "v1")  # fmt: skip


def test_ci_values_install_with_examples(bare_cluster, helm_bins):
    control_plane, namespace = bare_cluster, create_namespace(bare_cluster)
    session = Session(control_plane, helm_bins["helm4"])
    ci_rel, chart = str(CI_VALUES.relative_to(REPO_ROOT)), str(CHART.relative_to(REPO_ROOT))
    session.helm("version", "--short")
    session.helm("lint", "--strict", chart, "--values", ci_rel)
    session.kubectl(
        "apply", "--server-side", "-f", str(SERVICE_MONITOR_CRD),
        shown=f"kubectl apply --server-side -f {SERVICE_MONITOR_CRD.relative_to(REPO_ROOT)}  # stands in for the Prometheus Operator",
    )  # fmt: skip
    session.kubectl("wait", "--for=condition=Established", "crd/servicemonitors.monitoring.coreos.com")
    session.helm("install", "lp-ci", chart, "--namespace", namespace, "--values", ci_rel)
    out = session.kubectl(
        "get", "deployments,serviceaccounts,services,servicemonitors,lorabases", "-n", namespace
    )
    assert "deployment.apps/lp-ci-loraplane" in out and "lorabase.loraplane.dev/demo-base" in out
    out = session.kubectl("get", "clusterroles,clusterrolebindings", "-l", "app.kubernetes.io/instance=lp-ci")
    assert "clusterrole.rbac.authorization.k8s.io/lp-ci-loraplane" in out
    path = "jsonpath={.spec.template.spec.containers[0].securityContext}"
    security = session.kubectl("get", "deployment", "lp-ci-loraplane", "-n", namespace, "-o", path)
    assert '"runAsNonRoot":true' in security and '"readOnlyRootFilesystem":true' in security
    session.helm("uninstall", "lp-ci", "--namespace", namespace)
    leftover = control_plane.kubectl("get", "clusterroles", "-l", "app.kubernetes.io/instance=lp-ci").stdout
    assert "lp-ci-loraplane" not in leftover
    if os.environ.get("LORAPLANE_WRITE_TRANSCRIPTS") == "1":
        header = [
            "# helm install against the tests' kube-apiserver 1.37 (tests/controlplane), with helm v4.3.1",
            "# and kubectl 1.37. Written by LORAPLANE_WRITE_TRANSCRIPTS=1 .venv/bin/python -m pytest "
            "tests/chart/test_install.py",
            "",
        ]
        TRANSCRIPT.parent.mkdir(parents=True, exist_ok=True)
        TRANSCRIPT.write_text("\n".join(header + session.lines))
