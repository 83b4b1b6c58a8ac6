"""The CRD YAML is generated from code and current; the examples validate against it."""

from __future__ import annotations

import pathlib

import jsonschema
import pytest
import yaml

from loraplane.operator import crds
from loraplane.operator.crd_models import AdapterSpec, BaseSpec, SpecError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def schema_of(file_name: str) -> dict:
    crd = yaml.safe_load((ROOT / "crds" / file_name).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def examples() -> list[dict]:
    docs = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_committed_yaml_is_current():
    assert crds.main(["--check", str(ROOT / "crds")]) == 0, (
        "run: python -m loraplane.operator.crds --write crds/"
    )


def test_every_field_has_a_description():
    def walk(schema: dict, path: str):
        if path.count(".") > 1 and schema.get("type") and path.split(".")[-1] != "metadata":
            assert schema.get("description"), f"{path} has no description"
        for key, sub in (schema.get("properties") or {}).items():
            walk(sub, f"{path}.{key}")
        if "items" in schema:
            walk(schema["items"], f"{path}[]")

    for file_name in crds.FILES:
        walk(schema_of(file_name), file_name)


def test_crd_shape():
    base = crds.lorabase_crd()["spec"]
    adapter = crds.loraadapter_crd()["spec"]
    assert base["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert adapter["versions"][0]["subresources"] == {"status": {}}
    assert {c["name"] for c in adapter["versions"][0]["additionalPrinterColumns"]} >= {
        "Ready",
        "Version",
        "Age",
    }
    sha = base["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    assert "sha256" in sha["required"]
    uri = adapter["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["source"]
    assert "s3://" in uri["properties"]["uri"]["x-kubernetes-validations"][0]["rule"]


def test_examples_validate_against_the_schemas_and_parse():
    validators = {"LoRABase": schema_of("lorabase.yaml"), "LoRAAdapter": schema_of("loraadapter.yaml")}
    kinds = set()
    for doc in examples():
        if doc["kind"] in validators:
            jsonschema.validate(doc, validators[doc["kind"]])
            (BaseSpec if doc["kind"] == "LoRABase" else AdapterSpec).parse(doc["spec"])
            kinds.add(doc["kind"])
    assert kinds == {"LoRABase", "LoRAAdapter"}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"source": {"uri": "https://x/"}}, "spec.source.uri"),
        ({"source": {"uri": "s3://b/p/", "manifestDigest": "abc"}}, "spec.source.manifestDigest"),
        ({"version": "no spaces"}, "spec.version"),
        ({"residency": {"warm": "disk"}}, "spec.residency.warm"),
        ({"rollout": {"maxUnavailable": 0}}, "spec.rollout.maxUnavailable"),
        ({"baseRef": {"name": "Bad_Name"}}, "spec.baseRef.name"),
    ],
)
def test_bad_adapter_spec_is_refused_by_schema_and_parser(change, field):
    adapter = next(d for d in examples() if d["kind"] == "LoRAAdapter")
    adapter["spec"].update(change)
    with pytest.raises(SpecError) as info:
        AdapterSpec.parse(adapter["spec"])
    assert info.value.field == field
    if field != "spec.source.uri":  # CEL rules are the API server's, not jsonschema's
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(adapter, schema_of("loraadapter.yaml"))
