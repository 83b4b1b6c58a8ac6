"""The whole flow on the real control plane, with real server processes: install, refuse bad adapters, RBAC.

Each scenario is its own test; they share one stack (tests run in file order, and each makes sure of what it
needs). Server Pods are `loraplane serve` processes on CPU with the tiny model, so these take a minute or two.
"""

from __future__ import annotations

import subprocess

import yaml

from e2e.stack import API, POD_START, RELEASE, admin_list, condition, ensure_base, wait_for
from tests.chart.chart import CHART, ensure_tools
from tests.controlplane.fixtures import create_namespace


def test_scenario_1_helm_install_then_a_lorabase_with_two_ready_pods(stack):
    operator = wait_for(lambda: [p for p in stack.plane.list("v1", "Pod", stack.namespace)
                                 if p["metadata"]["name"].startswith(f"{RELEASE}-loraplane")
                                 and condition(p, "Ready").get("status") == "True"], POD_START,
                        f"the operator's Pod Ready\n{stack.logs()}")  # fmt: skip
    assert operator[0]["spec"]["serviceAccountName"] == f"{RELEASE}-loraplane"
    pods = ensure_base(stack)
    assert len({p["status"]["podIP"] for p in pods}) == 2, "each Pod has its own address"
    owners = {p["metadata"]["ownerReferences"][0]["kind"] for p in pods}
    assert owners == {"ReplicaSet"}, "the controller manager made the Pods from the operator's Deployment"
    base = wait_for(lambda: (b := stack.get("LoRABase", "demo")) and condition(b, "Ready").get("status") == "True"
                    and b, 60, "LoRABase Ready")  # fmt: skip
    assert base["status"]["readyReplicas"] == 2
    assert base["status"]["observedBaseHash"] == stack.base_hash, "every Pod loaded the pinned weights"
    deployment = stack.get("Deployment", "demo")
    assert deployment["status"]["readyReplicas"] == 2 and deployment["metadata"]["ownerReferences"][0]["kind"] == (
        "LoRABase")  # fmt: skip
    for pod in pods:
        assert admin_list(pod)["base_hash"] == stack.base_hash


def test_scenario_4_tampered_adapter_and_wrong_base_never_reach_a_pod(stack):
    pods = ensure_base(stack)
    stack.add_adapter("good", "tampered", "v1")
    stack.add_adapter("signed-other", "other", "v1", seed=1)
    client, uri = stack.s3.client(), stack.uris["good"]
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    other_bucket, other_prefix = stack.uris["signed-other"].removeprefix("s3://").split("/", 1)
    foreign = client.get_object(Bucket=other_bucket, Key=other_prefix + "loraplane-manifest.sig")[
        "Body"
    ].read()
    client.put_object(
        Bucket=bucket, Key=prefix + "loraplane-manifest.sig", Body=foreign
    )  # valid, of other bytes
    stack.add_adapter("wrong-base", "wrong-base", "v1", base_hash="77" * 32)
    stack.apply(
        stack.adapter_manifest("tampered", "good", "v1"),
        stack.adapter_manifest("wrong-base", "wrong-base", "v1"),
    )
    for name, reason in (("tampered", "BadSignature"), ("wrong-base", "BaseMismatch")):
        adapter = wait_for(lambda n=name, r=reason: (a := stack.get("LoRAAdapter", n)) and
                           condition(a, "Validated").get("reason") == r and a, 60, f"{name} {reason}")  # fmt: skip
        assert condition(adapter, "Validated")["status"] == "False"
        assert condition(adapter, "Ready")["status"] == "False"
    events = {e["reason"] for e in stack.plane.list("v1", "Event", stack.namespace)}
    assert {"BadSignature", "BaseMismatch"} <= events
    for pod in pods:
        loaded = {a.get("name") for a in admin_list(pod)["adapters"]}
        assert not loaded & {"tampered", "wrong-base"}
    for name in ("tampered", "wrong-base"):
        assert stack.admin_calls("PUT", name) == 0, f"a Pod was asked to load the unverified {name}"


def test_scenario_9_the_operator_cannot_read_secrets_it_was_not_pointed_at(stack):
    ensure_base(stack)
    plane, namespace = stack.plane, stack.namespace
    account = f"{RELEASE}-loraplane"
    token = plane.service_account_token(namespace, account)
    user = f"system:serviceaccount:{namespace}:{account}"
    # What the operator itself did with Secrets, before this test's own calls with its token.
    touched = {(e["verb"], e["objectRef"].get("name")) for e in plane.audit(user)
               if (e.get("objectRef") or {}).get("resource") == "secrets"}  # fmt: skip
    elsewhere = create_namespace(plane, "other")
    plane.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "db", "namespace": elsewhere},
                  "stringData": {"password": "x"}})  # fmt: skip
    refused = {
        "list its namespace's Secrets": f"/api/v1/namespaces/{namespace}/secrets",
        "watch them": f"/api/v1/namespaces/{namespace}/secrets?watch=true&timeoutSeconds=1",
        "read a Secret elsewhere": f"/api/v1/namespaces/{elsewhere}/secrets/db",
        "list Secrets cluster-wide": "/api/v1/secrets",
        "read kube-system": "/api/v1/namespaces/kube-system/secrets",
    }
    for what, path in refused.items():
        assert plane.request("GET", path, token=token)[0] == 403, f"the operator may {what}"
    plane.request("DELETE", f"/api/v1/namespaces/{elsewhere}")
    named = {"s3", "signers", "admin-token", "api-keys"}  # what the LoRABase points at
    assert {name for _, name in touched} <= named | {None}, touched
    assert ("get", "unrelated") not in touched and all(verb in {"get", "create"} for verb, _ in touched), (
        touched
    )


def test_the_operator_used_only_what_the_chart_grants(stack):
    """The minimality check, from the audit log: every request the operator made, against the chart's Role."""
    ensure_base(stack)
    user = f"system:serviceaccount:{stack.namespace}:{RELEASE}-loraplane"
    used = set()
    for event in stack.plane.audit(user):
        ref = event.get("objectRef") or {}
        if ref.get("resource"):
            resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            used.add((ref.get("apiGroup", ""), resource, event["verb"], event["responseStatus"]["code"]))
    denied = sorted(u for u in used if u[3] == 403)
    assert not denied, f"the operator needed more than the chart grants: {denied}"
    rendered = subprocess.run([str(ensure_tools()["helm4"]), "template", RELEASE, str(CHART), "--namespace",
                               stack.namespace, "--show-only", "templates/rbac.yaml"], capture_output=True, text=True,
                              check=True, timeout=120).stdout  # fmt: skip
    role = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Role")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}  # fmt: skip
    calls = {(g, r, v) for g, r, v, _ in used}
    unused = sorted(granted - calls)
    print(f"\noperator API use ({len(calls)}): {sorted(calls)}\ngranted but unused here: {unused}")
    assert calls <= granted | {("", "namespaces", "get")}, sorted(calls - granted)
    assert API.split("/")[0] in {g for g, _, _ in calls}
