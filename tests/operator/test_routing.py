"""Routing objects for the Gateway API Inference Extension: pure builders without a server, then the real
control plane with and without the extension's CRDs (tests/fixtures/gie-crds.yaml, cut from v1.5.0)."""

from __future__ import annotations

import asyncio
import pathlib
import time

import jsonschema
import pytest
import yaml

from loraplane.operator import builders as B
from loraplane.operator import routing
from loraplane.operator.context import Context
from loraplane.operator.crd_models import BaseSpec
from loraplane.operator.kube import Kube
from loraplane.operator.reconcile_adapter import name_in_pool
from loraplane.operator.reconcile_base import apply_objects
from loraplane.serve.options import build_parser
from tests.operator.test_builders import base as base_object

GIE_CRDS = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gie-crds.yaml"


def adapter_object(name: str = "chat", base_name: str = "demo", namespace: str = "ml") -> dict:
    return {
        "apiVersion": "loraplane.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name, "namespace": namespace, "uid": "uid-a"},
        "spec": {
            "baseRef": {"name": base_name},
            "source": {"uri": f"s3://adapters/{name}/v1/"},
            "version": "v1",
        },
    }


def crd_schema(kind: str) -> dict:
    """The spec schema the extension's CRD declares (validated here without the server's CEL rules)."""
    for crd in yaml.safe_load_all(GIE_CRDS.read_text()):
        if crd["spec"]["names"]["kind"] == kind:
            return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    raise LookupError(kind)


def test_pool_selects_the_base_pods_on_the_openai_port():
    b = base_object()
    pool = routing.build_inference_pool(b)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["spec"]["selector"]["matchLabels"] == B.selector("demo")
    template_labels = B.build_deployment(b, BaseSpec.parse(b["spec"]))["spec"]["template"]["metadata"][
        "labels"
    ]
    assert B.selector("demo").items() <= template_labels.items()  # the pool selects exactly the server pods
    assert pool["spec"]["targetPorts"] == [{"number": B.OPENAI_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "demo-epp", "port": {"number": 9002}, "failureMode": "FailClose",
    }  # fmt: skip
    assert pool["metadata"]["ownerReferences"] == [B.owner_reference(b)]
    jsonschema.validate(pool, crd_schema("InferencePool"))


def test_rewrite_names_the_adapter_in_its_base_pool():
    rewrite = routing.build_model_rewrite(adapter_object(), "demo")
    assert rewrite["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    assert rewrite["spec"]["poolRef"] == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                          "name": "demo"}  # fmt: skip
    assert rewrite["spec"]["rules"] == [
        {"matches": [{"model": {"type": "Exact", "value": "chat"}}],
         "targets": [{"modelRewrite": "chat", "weight": 100}]}
    ]  # fmt: skip
    owner = rewrite["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "LoRAAdapter",
        "chat",
        "uid-a",
        True,
    )
    assert rewrite["metadata"]["labels"]["loraplane.dev/base"] == "demo"
    jsonschema.validate(rewrite, crd_schema("InferenceModelRewrite"))


def test_routing_turns_on_the_pods_routing_metrics():
    b = base_object()
    spec = BaseSpec.parse(b["spec"])
    plain = B.build_deployment(b, spec)["spec"]["template"]["spec"]["containers"][0]["args"]
    routed = B.build_deployment(b, spec, routing=True)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--routing-metrics" not in plain and routed == [*plain, "--routing-metrics"]
    assert build_parser().parse_args(routed[1:]).routing_metrics is True  # the server's own parser reads it


# --- the real control plane ------------------------------------------------------------------------------


def _real_base(plane, namespace: str) -> dict:
    return plane.create({
        "apiVersion": "loraplane.dev/v1alpha1", "kind": "LoRABase",
        "metadata": {"name": "demo", "namespace": namespace},
        "spec": {"model": {"uri": "s3://m/", "sha256": "ab" * 32}, "replicas": 0},
    })  # fmt: skip


def _wait_gone(plane, api_version: str, kind: str, name: str, namespace: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            plane.get(api_version, kind, name, namespace)
        except LookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"{kind} {namespace}/{name} still there after {timeout}s")


def _reconcile_both(plane, namespace: str, base: dict, adapter: dict) -> list[str]:
    ctx = Context(Kube(plane.api_client()), routing=True)  # a fresh discovery cache
    changed = asyncio.run(apply_objects(ctx, base, BaseSpec.parse(base["spec"])))
    asyncio.run(name_in_pool(ctx, adapter, "demo"))
    return changed


@pytest.fixture
def gie_crds(control_plane):  # noqa: F811
    control_plane.kubectl("apply", "-f", str(GIE_CRDS))
    control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                          "crd/inferencepools.inference.networking.k8s.io",
                          "crd/inferencemodelrewrites.inference.networking.x-k8s.io")  # fmt: skip
    try:
        yield
    finally:
        control_plane.kubectl("delete", "-f", str(GIE_CRDS), "--wait=true", "--timeout=120s")


def test_without_the_crds_nothing_is_written_and_nothing_fails(control_plane, namespace):  # noqa: F811
    if any(
        r.get("name") == "inferencepools" for r in _discovery(control_plane, "inference.networking.k8s.io/v1")
    ):
        pytest.skip("the extension's CRDs are installed in this cluster")
    base = _real_base(control_plane, namespace)
    adapter = control_plane.create({**adapter_object(namespace=namespace), "metadata": {"name": "chat",
                                    "namespace": namespace}})  # fmt: skip
    changed = _reconcile_both(control_plane, namespace, base, adapter)
    assert changed == ["Secret/demo-admin-token", "Deployment/demo", "Service/demo", "Service/demo-admin"]
    args = control_plane.get("apps/v1", "Deployment", "demo", namespace)["spec"]["template"]["spec"]
    assert "--routing-metrics" in args["containers"][0]["args"]


def _discovery(plane, api_version: str) -> list[dict]:
    import json

    status, body = plane.request("GET", f"/apis/{api_version}")
    return json.loads(body).get("resources", []) if status == 200 else []


def test_with_the_crds_the_pool_and_rewrite_are_written_and_collected(control_plane, namespace, gie_crds):  # noqa: F811
    base = _real_base(control_plane, namespace)
    adapter = control_plane.create({**adapter_object(namespace=namespace), "metadata": {"name": "chat",
                                    "namespace": namespace}})  # fmt: skip
    changed = _reconcile_both(control_plane, namespace, base, adapter)
    assert "InferencePool/demo" in changed
    pool = control_plane.get(routing.POOL_VERSION, "InferencePool", "demo", namespace)
    assert pool["spec"]["selector"]["matchLabels"] == B.selector("demo")
    assert pool["metadata"]["ownerReferences"][0]["uid"] == base["metadata"]["uid"]
    rewrite = control_plane.get(routing.REWRITE_VERSION, "InferenceModelRewrite", "chat", namespace)
    assert rewrite["spec"]["rules"][0]["targets"] == [{"modelRewrite": "chat", "weight": 100}]
    assert rewrite["metadata"]["ownerReferences"][0]["uid"] == adapter["metadata"]["uid"]
    # A second pass writes nothing: the server's defaults are not a change.
    assert _reconcile_both(control_plane, namespace, base, adapter) == []
    # Deleting the owners: the garbage collector removes the routing objects.
    assert control_plane.delete("loraplane.dev/v1alpha1", "LoRAAdapter", "chat", namespace) == 200
    _wait_gone(control_plane, routing.REWRITE_VERSION, "InferenceModelRewrite", "chat", namespace)
    assert control_plane.delete("loraplane.dev/v1alpha1", "LoRABase", "demo", namespace) == 200
    _wait_gone(control_plane, routing.POOL_VERSION, "InferencePool", "demo", namespace)


def test_routing_off_writes_no_pool_even_with_the_crds(control_plane, namespace, gie_crds):  # noqa: F811
    base = _real_base(control_plane, namespace)
    ctx = Context(Kube(control_plane.api_client()))
    changed = asyncio.run(apply_objects(ctx, base, BaseSpec.parse(base["spec"])))
    assert not any(c.startswith("InferencePool") for c in changed)
    assert control_plane.list(routing.POOL_VERSION, "InferencePool", namespace) == []


def test_a_pool_someone_else_made_is_left_alone(control_plane, namespace, gie_crds):  # noqa: F811
    """GIE's own chart creates the pool (and its picker) under the release's name: no tug of war."""
    base = _real_base(control_plane, namespace)
    theirs = routing.build_inference_pool(base)
    theirs["metadata"] = {
        "name": "demo",
        "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": "Helm"},
    }
    theirs["spec"]["selector"] = {"matchLabels": {"app": "demo"}}
    control_plane.create(theirs)
    changed = asyncio.run(apply_objects(Context(Kube(control_plane.api_client()), routing=True), base,
                                        BaseSpec.parse(base["spec"])))  # fmt: skip
    assert not any(c.startswith("InferencePool") for c in changed)
    pool = control_plane.get(routing.POOL_VERSION, "InferencePool", "demo", namespace)
    assert (
        pool["spec"]["selector"] == {"matchLabels": {"app": "demo"}}
        and "ownerReferences" not in pool["metadata"]
    )
