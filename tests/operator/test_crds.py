"""The CRD YAML is generated from code and current; the examples validate against it."""

from __future__ import annotations

import pathlib

import jsonschema
import pytest
import yaml

from loraplane.operator import crds
from loraplane.operator.crd_models import ApiModel
from loraplane.operator.crd_objects import LoRAAdapter, LoRABase
from loraplane.operator.openapi import SchemaError, structural
from tests.operator.crd_schema import structural_problems

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
            (LoRABase if doc["kind"] == "LoRABase" else LoRAAdapter).parse(doc)
            kinds.add(doc["kind"])
    assert kinds == {"LoRABase", "LoRAAdapter"}


@pytest.mark.parametrize("file_name", sorted(crds.FILES))
def test_generated_crds_are_structural(file_name):
    """The rules the API server applies to a CRD's schema, checked offline."""
    assert structural_problems(schema_of(file_name)) == []


@pytest.mark.parametrize("file_name", sorted(crds.FILES))
def test_generated_crds_are_valid_customresourcedefinitions(file_name):
    """Against Kubernetes 1.37's own schema of the CustomResourceDefinition kind (unknown keys refused)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    crd = yaml.safe_load((ROOT / "crds" / file_name).read_text())
    kubernetes_validate.validate(crd, "1.37.0", strict=True)


def test_structural_check_can_fail():
    schema = {"type": "object", "properties": {"metadata": {"type": "object"}, "spec": {
        "type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}, "b": {"type": "array"}},
        "additionalProperties": {"type": "string"}}}}  # fmt: skip
    problems = structural_problems(schema)
    assert any("spec.a: keyword anyOf" in p for p in problems)
    assert any("spec.a: no type" in p for p in problems)
    assert any("spec.b: an array needs one items schema" in p for p in problems)
    assert any("spec: properties and additionalProperties together" in p for p in problems)


def test_generation_is_byte_stable(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert crds.main(["--write", str(first)]) == 0 and crds.main(["--write", str(second)]) == 0
    for name in crds.FILES:
        assert (
            (first / name).read_bytes() == (second / name).read_bytes() == (ROOT / "crds" / name).read_bytes()
        )
    (first / "lorabase.yaml").write_text(
        (first / "lorabase.yaml").read_text().replace("maximum: 512", "maximum: 513")
    )
    assert crds.main(["--check", str(first)]) == 1


def test_generator_refuses_what_kubernetes_cannot_express():
    class Either(ApiModel):
        """A union."""

        value: int | str = 0

    with pytest.raises(SchemaError, match="Either.value"):
        structural(Either)
