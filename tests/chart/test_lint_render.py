"""helm lint --strict and helm template, with helm v4 and helm3, default and CI values; the rendered
manifests validated strictly against the Kubernetes 1.37 schemas and the CRDs' own schemas."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest

from tests.chart.chart import CHART, NAMESPACE, closed, crd_schemas, helm, template

K8S_VERSION = "1.37.0"
# The Prometheus Operator's CRD is not part of Kubernetes; check the fields the chart relies on.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object"}},
                },
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


def test_lint_strict(helm_bin, values_files):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    for path in values_files:
        args += ["--values", str(path)]
    out = helm(helm_bin, *args)
    assert "0 chart(s) failed" in out.stdout, out.stdout


def test_rendered_manifests_validate(helm_bin, values_files):
    rendered = template(helm_bin, *values_files, include_crds=True)
    crs = crd_schemas(CHART / "crds")
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "Service"} <= set(rendered.kinds())
    for doc in rendered.docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "ServiceMonitor":
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
        elif (doc["apiVersion"], doc["kind"]) in crs:
            jsonschema.validate(doc, closed(crs[(doc["apiVersion"], doc["kind"])]))
        else:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where} is not a valid Kubernetes {K8S_VERSION} object: {exc.message}")


def test_ci_values_turn_on_every_optional_template(helm_bins):
    rendered = template(helm_bins["helm4"], CHART / "ci" / "ci-values.yaml")
    assert {"ServiceMonitor", "LoRABase", "ClusterRole", "ClusterRoleBinding"} <= set(rendered.kinds())


def test_defaults_are_namespaced_and_minimal(helm_bins):
    rendered = template(helm_bins["helm4"])
    kinds = rendered.kinds()
    assert {"Role", "RoleBinding"} <= set(kinds)
    assert not {"ClusterRole", "ClusterRoleBinding", "ServiceMonitor", "LoRABase"} & set(kinds)
    args = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={NAMESPACE}" in args and "--all-namespaces" not in args


def test_service_monitor_selects_the_metrics_service(helm_bins):
    rendered = template(helm_bins["helm4"], CHART / "ci" / "ci-values.yaml")
    monitor, service = rendered.one("ServiceMonitor"), rendered.one("Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {p["name"] for p in service["spec"]["ports"]} >= {e["port"] for e in monitor["spec"]["endpoints"]}


@pytest.mark.parametrize("overrides", [{}, {"watchAllNamespaces": True}, {"watchNamespaces": ["ml"]}])
def test_notes_say_the_next_step(helm_bins, overrides):
    args = ["install", "--dry-run=client", "lp", str(CHART), "--namespace", NAMESPACE]
    for key, value in overrides.items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    out = helm(helm_bins["helm4"], *args).stdout
    notes = out.split("NOTES:\n", 1)[1].strip().splitlines()
    assert len(notes) <= 6
    text = "\n".join(notes)
    assert "kubectl apply" in text and "lorabase" in text and "loraadapter" in text
    assert ("every namespace" in text) == bool(overrides.get("watchAllNamespaces"))
    assert f"-n {NAMESPACE}" in text
