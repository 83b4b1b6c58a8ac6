"""The generated CRDs on a real kube-apiserver: installed (the control plane fixture applies crds/),
the examples accepted, every invalid object of the table refused naming the field the model names,
and the server's defaults equal to the model's."""

from __future__ import annotations

import copy
import json

import pytest

from loraplane.operator.crd_objects import LoRAAdapter, LoRABase
from tests.operator.test_crd_models import ADAPTER, BASE, INVALID, example, model_error, with_

fixtures = pytest.importorskip("tests.controlplane.fixtures", reason="needs the real control plane")
control_plane, namespace = fixtures.control_plane, fixtures.namespace
MODELS = {BASE: LoRABase, ADAPTER: LoRAAdapter}


def post(plane, namespace: str, obj: dict) -> tuple[int, dict]:
    obj = copy.deepcopy(obj)
    obj["metadata"] = {**obj["metadata"], "namespace": namespace}
    status, body = plane.request("POST", plane.path(obj["apiVersion"], obj["kind"], namespace=namespace), obj)
    return status, json.loads(body) if isinstance(body, bytes) else body


@pytest.mark.parametrize(
    ("kind", "where", "value", "field"), INVALID, ids=[f"{c[1]}={c[2]!r:.20}" for c in INVALID]
)
def test_the_api_server_refuses_what_the_model_refuses_naming_the_same_field(
    control_plane, namespace, kind, where, value, field
):
    obj = with_(kind, where, value)
    assert model_error(obj).field == field
    status, body = post(control_plane, namespace, obj)
    assert status == 422, body
    causes = body.get("details", {}).get("causes", [])
    named = {c.get("field", "") for c in causes}
    if field == "metadata.name":  # a root CEL rule: the server reports it at the root, by its message
        assert any("metadata.name" in c.get("message", "") for c in causes), body
    else:
        assert field in named, body


@pytest.mark.parametrize("kind", [BASE, ADAPTER])
def test_the_examples_are_accepted_and_defaulted_as_the_model_defaults(control_plane, namespace, kind):
    obj = example(kind)
    if kind == BASE:  # every section present and empty: the server fills in each default
        obj["spec"] = {"model": obj["spec"]["model"], "resources": {}, "engine": {}, "hostCache": {},
                       "storage": {"credentialsSecretRef": {"name": "s3"}}, "adminTokenSecretRef": {"name": "t"}}  # fmt: skip
    else:
        obj["spec"] = {**obj["spec"], "residency": {}, "rollout": {}}
    status, created = post(control_plane, namespace, obj)
    assert status == 201, created
    model = MODELS[kind]
    assert model.parse(created).spec == model.parse(obj).spec  # the server's defaults are the model's
    assert created["spec"] != obj["spec"]  # and it did fill them in
