"""The pure builders: objects a LoRABase owns, checked without any server."""

from __future__ import annotations

import base64
import copy

import pytest

from loraplane.operator import builders as B
from loraplane.operator.crd_models import BaseSpec

SHA = "ab" * 32


def base(**spec_overrides) -> dict:
    spec = {
        "model": {"uri": "s3://models/demo/", "sha256": SHA},
        "replicas": 2,
        "storage": {
            "endpoint": "http://s3.local:9000",
            "region": "eu-1",
            "credentialsSecretRef": {"name": "s3"},
        },
        "trust": {"publicKeysSecretRef": {"name": "signers"}},
        "auth": {"apiKeysSecretRef": {"name": "keys"}},
        **spec_overrides,
    }
    return {
        "apiVersion": "loraplane.dev/v1alpha1",
        "kind": "LoRABase",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": spec,
    }


def deployment(b: dict) -> dict:
    return B.build_deployment(b, BaseSpec.parse(b["spec"]))


def container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_every_object_is_owned_by_the_base():
    b = base()
    spec = BaseSpec.parse(b["spec"])
    objects = [
        B.build_deployment(b, spec),
        B.build_service(b),
        B.build_admin_service(b),
        B.build_admin_token_secret(b),
    ]
    for obj in objects:
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {"apiVersion": "loraplane.dev/v1alpha1", "kind": "LoRABase", "name": "demo", "uid": "uid-1",
                         "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"][B.BASE_LABEL] == "demo"


def test_deployment_runs_the_server_with_its_contract():
    dep = deployment(base())
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["selector"]["matchLabels"] == B.selector("demo")
    c = container(dep)
    assert c["args"][0] == "serve"
    assert f"--model-sha256={SHA}" in c["args"]
    assert f"--port={B.OPENAI_PORT}" in c["args"] and f"--admin-port={B.ADMIN_PORT}" in c["args"]
    assert "--trusted-keys-dir=/etc/loraplane/trusted-keys" in c["args"]
    assert "--usage-log-dir=/var/cache/loraplane/usage/$(POD_NAME)" in c["args"]  # one folder per pod
    env = {e["name"]: e.get("value") for e in c["env"]}
    cache = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "host-cache")
    assert env["TRITON_CACHE_DIR"].startswith(cache + "/")  # compiled kernels outlive the pod with the cache
    pod_name = next(e for e in c["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "admin": 8001}
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_secrets_reach_pods_only_by_reference():
    dep = deployment(base())
    c = container(dep)
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ENDPOINT_URL_S3"]["value"] == "http://s3.local:9000"
    assert env["AWS_REGION"]["value"] == "eu-1"
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "s3", "key": "AWS_ACCESS_KEY_ID"}
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["trusted-keys"]["secret"]["secretName"] == "signers"
    assert volumes["api-keys"]["secret"]["secretName"] == "keys"
    assert volumes["admin-token"]["secret"]["secretName"] == "demo-admin-token"
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_referenced_admin_token_is_mounted_instead_of_generated():
    b = base(adminTokenSecretRef={"name": "my-token", "key": "admin"})
    c = container(deployment(b))
    assert "--admin-token-file=/etc/loraplane/admin/admin" in c["args"]
    volumes = {v["name"]: v for v in deployment(b)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["admin-token"]["secret"]["secretName"] == "my-token"


def test_generated_admin_token_is_random_and_owned():
    b = base()
    one, two = B.build_admin_token_secret(b), B.build_admin_token_secret(b)
    assert one["metadata"]["name"] == "demo-admin-token"
    assert one["data"]["token"] != two["data"]["token"]
    assert len(base64.b64decode(one["data"]["token"])) >= 32


def test_spec_change_changes_template_hash_and_nothing_else_does():
    b = base()
    first = deployment(b)["spec"]["template"]["metadata"]["annotations"][B.TEMPLATE_HASH]
    assert (
        deployment(copy.deepcopy(b))["spec"]["template"]["metadata"]["annotations"][B.TEMPLATE_HASH] == first
    )
    changed = base(engine={"maxRank": 16})
    assert deployment(changed)["spec"]["template"]["metadata"]["annotations"][B.TEMPLATE_HASH] != first
    scaled = base(replicas=5)  # scaling is not a reason to roll pods
    assert deployment(scaled)["spec"]["template"]["metadata"]["annotations"][B.TEMPLATE_HASH] == first


@pytest.mark.parametrize(
    "spec, gpus, tp_arg",
    [
        ({}, "1", None),
        ({"tensorParallelSize": 4}, "4", "--tensor-parallel-size=4"),
        ({"tensorParallelSize": 2, "resources": {"gpus": 2, "gpuResource": "amd.com/gpu"}}, "2",
         "--tensor-parallel-size=2"),
    ],
)  # fmt: skip
def test_tensor_parallel_pod_gets_its_gpus_args_and_shm(spec, gpus, tp_arg):
    b = base(**spec)
    pod = deployment(b)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    resource = spec.get("resources", {}).get("gpuResource", "nvidia.com/gpu")
    assert c["resources"]["requests"][resource] == c["resources"]["limits"][resource] == gpus
    assert [a for a in c["args"] if a.startswith("--tensor-parallel-size")] == ([tp_arg] if tp_arg else [])
    shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    mounted = {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    if tp_arg:
        assert len(shm) == 1 and mounted == {shm[0]["name"]}
    else:
        assert shm == [] and mounted == set()


@pytest.mark.parametrize(
    "engine, flag", [({}, None), ({"memoryMode": "unified"}, "--memory-mode=unified"),
                     ({"memoryMode": "split"}, "--memory-mode=split")],
)  # fmt: skip
def test_memory_mode_reaches_the_server_only_when_set(engine, flag):
    args = container(deployment(base(engine=engine)))["args"]
    assert [a for a in args if a.startswith("--memory-mode")] == ([flag] if flag else [])


def test_cpu_tensor_parallel_requests_no_gpu():
    c = container(deployment(base(tensorParallelSize=2, resources={"gpus": 0})))
    assert not any("gpu" in key for key in c["resources"]["limits"])
    assert "--tensor-parallel-size=2" in c["args"]


def test_host_cache_and_scheduling():
    b = base(
        hostCache={"type": "hostPath", "path": "/mnt/lora", "sizeLimit": "10Gi"},
        nodeSelector={"gpu": "h200"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}],
        affinity={"nodeAffinity": {}},
        priorityClassName="inference-high",
        serviceAccountName="adapter-reader",
        runtimeClassName="nvidia",
    )
    pod = deployment(b)["spec"]["template"]["spec"]
    assert (pod["priorityClassName"], pod["serviceAccountName"], pod["runtimeClassName"]) == (
        "inference-high", "adapter-reader", "nvidia")  # fmt: skip
    assert pod["automountServiceAccountToken"] is False, (
        "a named ServiceAccount lends its identity, not a token"
    )
    bare = deployment(base())["spec"]["template"]["spec"]
    assert not {"priorityClassName", "serviceAccountName", "runtimeClassName"} & set(bare)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["host-cache"]["hostPath"]["path"] == "/mnt/lora"
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["affinity"] == {"nodeAffinity": {}}
    assert "emptyDir" in {k for v in deployment(base())["spec"]["template"]["spec"]["volumes"] for k in v}


def test_services_split_openai_and_admin_ports():
    b = base()
    assert B.build_service(b)["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http",
                                                    "protocol": "TCP"}]  # fmt: skip
    admin = B.build_admin_service(b)
    assert admin["metadata"]["name"] == "demo-admin" and admin["spec"]["ports"][0]["port"] == 8001
    assert B.endpoint(b) == "http://demo.ml.svc:8000/v1"


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"model": {"uri": "x"}}, "spec.model.sha256"),
        ({"model": {"uri": "x", "sha256": "XYZ"}}, "spec.model.sha256"),
        ({"model": {"uri": "x", "sha256": SHA}, "replicas": -1}, "spec.replicas"),
        ({"model": {"uri": "x", "sha256": SHA}, "engine": {"dtype": "int4"}}, "spec.engine.dtype"),
        (
            {"model": {"uri": "x", "sha256": SHA}, "engine": {"gpuAdapterBytes": "lots"}},
            "spec.engine.gpuAdapterBytes",
        ),
        ({"model": {"uri": "x", "sha256": SHA}, "hostCache": {"type": "hostPath"}}, "spec.hostCache.path"),
        ({"model": {"uri": "x", "sha256": SHA}, "tensorParallelSize": 16}, "spec.tensorParallelSize"),
        (
            {"model": {"uri": "x", "sha256": SHA}, "tensorParallelSize": 2, "resources": {"gpus": 1}},
            "spec.resources.gpus",
        ),
        (
            {
                "model": {"uri": "x", "sha256": SHA},
                "tensorParallelSize": 2,
                "engine": {"memoryMode": "unified"},
            },
            "spec.engine.memoryMode",
        ),
    ],
)
def test_bad_base_spec_names_the_field(spec, field):
    from loraplane.operator.crd_models import SpecError

    with pytest.raises(SpecError) as info:
        BaseSpec.parse(spec)
    assert info.value.field == field


def test_quantities():
    from loraplane.operator.crd_models import quantity_bytes

    assert quantity_bytes("4Gi", "f") == 4 << 30
    assert quantity_bytes("512Mi", "f") == 512 << 20
    assert quantity_bytes("1000", "f") == 1000
    assert quantity_bytes("2G", "f") == 2 * 10**9
