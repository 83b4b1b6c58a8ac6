"""The CRDs as the real API server serves them: CEL rules refuse bad objects, explain and printer columns."""

from __future__ import annotations

import yaml

API = "loraplane.dev/v1alpha1"


def adapter(namespace: str, name: str = "chat", uri: str = "s3://adapters/chat/v1/") -> dict:
    return {"apiVersion": API, "kind": "LoRAAdapter", "metadata": {"name": name, "namespace": namespace},
            "spec": {"baseRef": {"name": "demo"}, "source": {"uri": uri}, "version": "v1"}}  # fmt: skip


def base(namespace: str, **spec) -> dict:
    return {"apiVersion": API, "kind": "LoRABase", "metadata": {"name": "demo", "namespace": namespace},
            "spec": {"model": {"uri": "s3://models/tiny/", "sha256": "ab" * 32}, **spec}}  # fmt: skip


def refused(plane, obj: dict) -> str:
    """kubectl apply of ``obj`` must fail; what the user reads."""
    result = plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert result.returncode != 0, f"the server accepted {obj['metadata']['name']}: {result.stdout}"
    return result.stderr


def test_cel_rules_refuse_invalid_objects_and_name_the_field(control_plane, namespace):
    message = refused(control_plane, adapter(namespace, uri="https://example.invalid/chat/"))
    assert "spec.source.uri" in message and "must be an s3://bucket/prefix/ URI" in message
    message = refused(control_plane, adapter(namespace, name="chat.v1"))  # a valid object name, not ours
    assert "metadata.name must match" in message  # the CRD's own CEL rule, not the server's name check
    message = refused(control_plane, base(namespace, hostCache={"type": "hostPath"}))
    assert "spec.hostCache" in message and "path is required when type is hostPath" in message
    control_plane.kubectl(
        "apply", "-f", "-", input=yaml.safe_dump(adapter(namespace))
    )  # the valid one passes
    assert control_plane.get(API, "LoRAAdapter", "chat", namespace)["spec"]["source"]["uri"].startswith(
        "s3://"
    )


def test_openapi_schema_rejects_wrong_types_and_unknown_fields(control_plane, namespace):
    bad = base(namespace, replicas="two")
    assert "spec.replicas" in refused(control_plane, bad)
    unknown = adapter(namespace)
    unknown["spec"]["sauce"] = 1
    result = control_plane.kubectl("apply", "--validate=strict", "-f", "-", input=yaml.safe_dump(unknown),
                                   check=False)  # fmt: skip
    assert result.returncode != 0 and 'unknown field "spec.sauce"' in result.stderr


def test_kubectl_explain_reads_the_served_schema(control_plane):
    text = control_plane.kubectl("explain", "loraadapters.spec.source.uri").stdout
    assert "s3://bucket/prefix/ holding loraplane-manifest.json" in text
    fields = control_plane.kubectl("explain", "lorabases.spec").stdout
    assert "model" in fields and "replicas" in fields


def test_printer_columns_through_kubectl_get(control_plane, namespace):
    control_plane.create(adapter(namespace))
    canary = {"version": "v2", "digest": "sha256:" + "0" * 64, "step": 1, "steps": 2, "weight": 20}
    status = {"status": {"servingVersion": "v1", "readyPods": 2, "desiredPods": 2, "canary": canary, "conditions": [
        {"type": "Ready", "status": "True", "reason": "Serving", "message": "", "lastTransitionTime":
         "2026-01-01T00:00:00Z"}]}}  # fmt: skip
    path = control_plane.path(API, "LoRAAdapter", "chat", namespace) + "/status"
    code, body = control_plane.request("PATCH", path, status, content_type="application/merge-patch+json")
    assert code == 200, body
    lines = control_plane.kubectl("get", "loraadapters", "-n", namespace).stdout.splitlines()
    assert lines[0].split() == ["NAME", "READY", "VERSION", "PODS-READY", "DESIRED", "REASON", "CANARY-STEP",
                                "CANARY-WEIGHT", "AGE"]  # fmt: skip
    assert lines[1].split()[:8] == ["chat", "True", "v1", "2", "2", "Serving", "1", "20"]
    wide = control_plane.kubectl("get", "loraadapters", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert "DESIRED-VERSION" in wide[0] and "BASE" in wide[0] and "demo" in wide[1]
