"""kube.py against the emulator: idempotent apply, 409 re-read and re-apply, status, secrets by name."""

from __future__ import annotations

import asyncio

from loraplane.operator import builders as B
from loraplane.operator.crd_models import BaseSpec
from loraplane.operator.kube import Kube, Ref, is_subset


def _base(uid: str) -> dict:
    return {
        "apiVersion": "loraplane.dev/v1alpha1",
        "kind": "LoRABase",
        "metadata": {"name": "demo", "namespace": "default", "uid": uid},
        "spec": {"model": {"uri": "s3://m/", "sha256": "ab" * 32}},
    }


def test_apply_is_idempotent_and_retries_conflicts(kube_emulator):  # noqa: F811
    kube = Kube(kube_emulator.api_client())
    base = _base("u1")
    desired = B.build_deployment(base, BaseSpec.parse(base["spec"]))
    assert asyncio.run(kube.apply(desired)) == "created"
    assert asyncio.run(kube.apply(desired)) == "unchanged"
    writes = kube_emulator.count_requests("PUT", "/deployments/demo")
    changed = B.build_deployment(base, BaseSpec.parse({**base["spec"], "replicas": 3}))
    kube_emulator.fail("PUT", r".*/deployments/demo", 409, times=2, reason="Conflict")
    assert asyncio.run(kube.apply(changed)) == "updated"
    assert kube_emulator.count_requests("PUT", "/deployments/demo") == writes + 3  # two 409s, then the write
    assert kube_emulator.get("apps/v1", "Deployment", "demo")["spec"]["replicas"] == 3


def test_admin_token_is_created_once_and_read_by_name(kube_emulator):  # noqa: F811
    kube = Kube(kube_emulator.api_client())
    base = _base("u2")
    assert asyncio.run(kube.create_if_absent(B.build_admin_token_secret(base, token="one")))
    assert not asyncio.run(kube.create_if_absent(B.build_admin_token_secret(base, token="two")))
    assert asyncio.run(kube.secret_data("default", "demo-admin-token")) == {"token": "one"}
    assert asyncio.run(kube.secret_data("default", "missing")) is None
    listed = [r for r in kube_emulator.requests if r.path.endswith("/secrets") and r.method == "GET"]
    assert not listed, "Secrets are never listed"


def test_status_patch_of_a_missing_object_is_none(kube_emulator):  # noqa: F811
    kube = Kube(kube_emulator.api_client())
    assert asyncio.run(kube.patch_status(Ref("/api/v1", "pods", "default", "nope"), {"phase": "x"})) is None


def test_is_subset_ignores_server_defaults():
    want = {"spec": {"containers": [{"name": "a", "image": "i"}]}}
    have = {"spec": {"containers": [{"name": "a", "image": "i", "imagePullPolicy": "IfNotPresent"}], "x": 1}}
    assert is_subset(want, have)
    assert not is_subset({"spec": {"containers": [{"name": "a"}, {"name": "b"}]}}, have)
