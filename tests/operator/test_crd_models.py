"""The pydantic models and the generated schema refuse the same specs, naming the same field.

The schema side is the API server's behaviour emulated offline (crd_schema.py: pruning, defaults,
OpenAPI validation, CEL through a real CEL engine); e2e/test_cluster_crds.py asks a real server.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from loraplane.operator.crd_models import AdapterSpec, BaseSpec, SpecError
from loraplane.operator.crd_objects import LoRAAdapter, LoRABase, LoRABaseStatus, status_patch
from tests.operator.crd_schema import ROOT, server_errors

MODELS = {"LoRABase": LoRABase, "LoRAAdapter": LoRAAdapter}
SHA = "a" * 64


def example(kind: str) -> dict:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind:
                return doc
    raise AssertionError(f"no {kind} in examples/")


def model_error(obj: dict) -> SpecError:
    with pytest.raises(SpecError) as info:
        MODELS[obj["kind"]].parse(obj)
    return info.value


def with_(kind: str, path: str, value) -> dict:
    """The example with ``path`` (dotted) set to ``value``, or removed when value is DELETE."""
    obj = copy.deepcopy(example(kind))
    *parents, last = path.split(".")
    node = obj
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return obj


class _Delete:
    def __repr__(self) -> str:
        return "<removed>"


DELETE = _Delete()
BASE, ADAPTER = "LoRABase", "LoRAAdapter"
# Unified memory is one GPU's pool: with two tensor-parallel ranks the spec is refused (a CEL rule on spec).
UNIFIED_ON_TWO_RANKS = {**example(BASE)["spec"], "tensorParallelSize": 2, "engine": {"memoryMode": "unified"}}
INVALID = [
    # (kind, where, value, the field both must name)
    (BASE, "spec.model", DELETE, "spec.model"),
    (BASE, "spec.model.sha256", DELETE, "spec.model.sha256"),
    (BASE, "spec.model.sha256", "ABC", "spec.model.sha256"),
    (BASE, "spec.model.uri", "", "spec.model.uri"),
    (BASE, "spec.replicas", 257, "spec.replicas"),
    (BASE, "spec.replicas", -1, "spec.replicas"),
    (BASE, "spec.replicas", "3", "spec.replicas"),
    (BASE, "spec.image", "", "spec.image"),
    (BASE, "spec.resources.gpus", 17, "spec.resources.gpus"),
    (BASE, "spec.tensorParallelSize", 0, "spec.tensorParallelSize"),
    (BASE, "spec.tensorParallelSize", 9, "spec.tensorParallelSize"),
    (BASE, "spec.tensorParallelSize", "2", "spec.tensorParallelSize"),
    (BASE, "spec.resources.gpus", 2, "spec.resources.gpus"),  # CEL: one GPU per rank (tensorParallelSize 1)
    (BASE, "spec.engine.maxRank", 0, "spec.engine.maxRank"),
    (BASE, "spec.engine.maxRank", 513, "spec.engine.maxRank"),
    (BASE, "spec.engine.kvCacheFraction", 0.99, "spec.engine.kvCacheFraction"),
    (BASE, "spec.engine.maxNumSeqs", 4097, "spec.engine.maxNumSeqs"),
    (BASE, "spec.engine.dtype", "int8", "spec.engine.dtype"),
    (BASE, "spec.engine.memoryMode", "shared", "spec.engine.memoryMode"),
    (BASE, "spec", UNIFIED_ON_TWO_RANKS, "spec.engine.memoryMode"),  # CEL, with fieldPath
    (BASE, "spec.engine.gpuAdapterBytes", "4GB", "spec.engine.gpuAdapterBytes"),
    (BASE, "spec.hostCache", {"type": "hostPath"}, "spec.hostCache.path"),  # CEL, with fieldPath
    (BASE, "spec.hostCache.type", "nfs", "spec.hostCache.type"),
    (BASE, "spec.hostCache.path", "relative/dir", "spec.hostCache.path"),
    (BASE, "spec.hostCache.sizeLimit", "lots", "spec.hostCache.sizeLimit"),
    (BASE, "spec.storage.endpoint", "ftp://store", "spec.storage.endpoint"),
    (BASE, "spec.storage.credentialsSecretRef", {}, "spec.storage.credentialsSecretRef.name"),
    (BASE, "spec.trust.publicKeysSecretRef.name", "Bad_Name", "spec.trust.publicKeysSecretRef.name"),
    (BASE, "spec.adminTokenSecretRef", {"name": "-token"}, "spec.adminTokenSecretRef.name"),
    (BASE, "spec.nodeSelector", {"gpu": 1}, "spec.nodeSelector.gpu"),
    (BASE, "spec.tolerations", ["NoSchedule"], "spec.tolerations[0]"),
    (BASE, "metadata.name", "b" * 58, "metadata.name"),  # <name>-admin must stay a 63-character label
    (BASE, "metadata.name", "9lives", "metadata.name"),  # a Service name starts with a letter
    (ADAPTER, "spec.baseRef", DELETE, "spec.baseRef"),
    (ADAPTER, "spec.version", DELETE, "spec.version"),
    (ADAPTER, "spec.baseRef.name", "Bad_Name", "spec.baseRef.name"),
    (ADAPTER, "spec.source.uri", "https://bucket/p/", "spec.source.uri"),  # CEL on a field
    (ADAPTER, "spec.source.uri", "s3://", "spec.source.uri"),
    (ADAPTER, "spec.source.manifestDigest", "sha256:abc", "spec.source.manifestDigest"),
    (ADAPTER, "spec.version", "no spaces", "spec.version"),
    (ADAPTER, "spec.version", "v" * 64, "spec.version"),
    (ADAPTER, "spec.residency.warm", "disk", "spec.residency.warm"),
    (ADAPTER, "spec.residency.pin", "yes", "spec.residency.pin"),
    (ADAPTER, "spec.rollout.maxUnavailable", 0, "spec.rollout.maxUnavailable"),
    (ADAPTER, "metadata.name", "chat." * 48 + "v1", "metadata.name"),  # 242 dotted characters
    (ADAPTER, "metadata.name", "a" * 64, "metadata.name"),
    (ADAPTER, "metadata.name", "Support_Bot", "metadata.name"),
]


@pytest.mark.parametrize(
    ("kind", "where", "value", "field"), INVALID, ids=[f"{c[1]}={c[2]!r:.20}" for c in INVALID]
)
def test_invalid_spec_is_refused_by_model_and_schema_naming_the_field(kind, where, value, field):
    obj = with_(kind, where, value)
    assert model_error(obj).field == field
    errors = server_errors(kind, obj)
    assert errors, f"the schema accepts {where}={value!r}"
    if field == "metadata.name":  # a root CEL rule: the server reports it at the root, by its message
        assert errors[0][0] == "" and errors[0][1].startswith("metadata.name")
    else:
        assert errors[0][0] == field, errors


@pytest.mark.parametrize(("mode", "ranks"), [("unified", 1), ("split", 2), (DELETE, 2), (DELETE, 1)], ids=str)
def test_memory_mode_is_accepted_where_the_engine_runs_it(mode, ranks):
    obj = with_(BASE, "spec.engine.memoryMode", mode)
    obj["spec"]["tensorParallelSize"] = ranks
    assert server_errors(BASE, obj) == []
    engine = LoRABase.parse(obj).spec.engine
    assert engine.memory_mode == (None if mode is DELETE else mode)


@pytest.mark.parametrize("kind", [BASE, ADAPTER])
def test_examples_are_accepted_by_model_and_schema(kind):
    obj = example(kind)
    assert server_errors(kind, obj) == []
    assert MODELS[kind].parse(obj).spec is not None


def test_test_fixtures_parse():
    from tests.operator.harness import World

    world = World.__new__(World)  # the manifests only, without an emulator
    world.ns, world.base_hash, world.max_rank = "ns", SHA, 16
    world.s3 = type("S3", (), {"url": "http://127.0.0.1:9000"})()
    fixtures = [world.base_manifest(), world.adapter_manifest("chat", "s3://a/chat/v1/", "v1")]
    fixtures.append(
        world.adapter_manifest("pinned", "s3://a/p/", "v2", residency={"pin": True, "warm": "gpu"})
    )
    for obj in fixtures:
        assert server_errors(obj["kind"], obj) == []
        MODELS[obj["kind"]].parse(obj)


def test_gpus_follow_tensor_parallel_size_unless_set():
    obj = with_(BASE, "spec.tensorParallelSize", 4)
    assert server_errors(BASE, obj) == []
    assert LoRABase.parse(obj).spec.gpus == 4
    obj["spec"]["resources"]["gpus"] = 0  # the engine on CPU (gloo)
    assert server_errors(BASE, obj) == []
    assert LoRABase.parse(obj).spec.gpus == 0
    obj["spec"]["resources"]["gpus"] = 2
    assert server_errors(BASE, obj)[0][0] == "spec.resources.gpus"
    assert model_error(obj).field == "spec.resources.gpus"


def test_parsed_values_and_defaults():
    base = BaseSpec.parse({"model": {"uri": "s3://m/", "sha256": SHA}, "engine": {"gpuAdapterBytes": "2Gi"}})
    assert (base.engine.gpu_adapter_bytes, base.engine.host_adapter_bytes) == (2 << 30, 16 << 30)
    assert (base.replicas, base.gpus, base.host_cache_type, base.admin_token) == (1, 1, "emptyDir", None)
    assert (base.storage.credentials, base.storage.access_key_id_key) == (None, "AWS_ACCESS_KEY_ID")
    adapter = AdapterSpec.parse(
        {"baseRef": {"name": "demo"}, "source": {"uri": "s3://b/p/"}, "version": "v1"}
    )
    assert (adapter.base, adapter.uri, adapter.warm, adapter.pin, adapter.max_unavailable) == (
        "demo", "s3://b/p/", "host", False, 1)  # fmt: skip


def test_null_is_absent_and_unknown_fields_are_ignored_as_the_server_prunes_them():
    spec = {"model": {"uri": "s3://m/", "sha256": SHA}, "replicas": None, "futureField": {"x": 1}}
    assert BaseSpec.parse(spec).replicas == 1
    assert server_errors(BASE, {"metadata": {"name": "b"}, "spec": spec}) == []


def test_every_problem_is_reported_with_its_path():
    with pytest.raises(SpecError) as info:
        BaseSpec.parse({"model": {"uri": "s3://m/"}, "engine": {"maxRank": 0, "dtype": "int8"}})
    paths = [path for path, _ in info.value.problems]
    assert paths == ["spec.model.sha256", "spec.engine.maxRank", "spec.engine.dtype"]
    assert str(info.value).startswith("spec.model.sha256: Field required")


def test_status_is_written_through_the_model():
    patch = status_patch("lorabases", {"readyReplicas": 2, "observedBaseHash": None, "conditions": [
        {"type": "Ready", "status": "True", "reason": "DeploymentAvailable", "message": None}]})  # fmt: skip
    # None removes the key (merge patch); None inside a condition is just absent.
    assert patch == {"readyReplicas": 2, "observedBaseHash": None,
                     "conditions": [{"type": "Ready", "status": "True", "reason": "DeploymentAvailable"}]}  # fmt: skip
    assert LoRABaseStatus(ready_replicas=1).patch() == {"readyReplicas": 1}
    with pytest.raises(ValueError, match="readyReplica"):
        status_patch("lorabases", {"readyReplica": 2})  # a misspelt key never reaches the server
    with pytest.raises(ValueError, match="status"):
        status_patch("loraadapters", {"conditions": [{"type": "Ready", "status": "Yes"}]})
    with pytest.raises(ValueError, match="state"):
        status_patch("loraadapters", {"pods": [{"name": "p", "state": "Sleeping"}]})


def test_the_operator_refuses_an_adapter_name_no_url_segment_should_carry():
    """Where no API server ran the CEL rules (an older cluster, a restore), the operator itself refuses the
    242-character dotted name: InvalidSpec naming metadata.name, before any pod's admin URL is built."""
    import asyncio

    from loraplane.operator import conditions as C
    from loraplane.operator.reconcile_adapter import run_pass

    adapter = with_(ADAPTER, "metadata.name", "chat." * 48 + "v1")
    adapter["metadata"]["namespace"] = "ns"
    verdict, views = asyncio.run(run_pass(None, adapter, None, []))
    status, reason, message = verdict.conditions[C.VALIDATED]
    assert (status, reason, views) == (C.FALSE, "InvalidSpec", [])
    assert message.startswith("metadata.name: metadata.name must be at most 63 characters")
