"""The chart ships the operator's CRDs unchanged, and the example CRs match the CRD schemas."""

from __future__ import annotations

import importlib.util

import jsonschema
import pytest

from tests.chart.chart import CHART, REPO_ROOT, closed, crd_schemas, load_docs

_spec = importlib.util.spec_from_file_location(
    "sync_chart_crds", REPO_ROOT / "scripts" / "sync_chart_crds.py"
)
sync_chart_crds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sync_chart_crds)

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))


def test_chart_crds_identical_to_top_level():
    assert sorted(p.name for p in (REPO_ROOT / "crds").glob("*.yaml")), "top-level crds/ is empty"
    problems = sync_chart_crds.differences()
    assert not problems, "\n".join(problems) + "\nrun: .venv/bin/python scripts/sync_chart_crds.py"


def test_sync_detects_and_repairs_drift(tmp_path):
    source, copy = tmp_path / "crds", tmp_path / "chart-crds"
    source.mkdir()
    (source / "a.yaml").write_text("kind: A\n")
    (source / "b.yaml").write_text("kind: B\n")
    copy.mkdir()
    (copy / "a.yaml").write_text("kind: A \n")  # one byte differs
    (copy / "stale.yaml").write_text("kind: Old\n")
    problems = sync_chart_crds.differences(source, copy)
    assert len(problems) == 3 and any("b.yaml" in p for p in problems) and any("stale" in p for p in problems)
    sync_chart_crds.sync(source, copy)
    assert sync_chart_crds.differences(source, copy) == []


def test_crds_cover_both_kinds():
    kinds = {kind for _, kind in crd_schemas(CHART / "crds")}
    assert kinds == {"LoRABase", "LoRAAdapter"}


@pytest.mark.skipif(not EXAMPLES, reason="examples/ has no YAML yet (the operator issue adds them)")
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_match_crd_schemas(path):
    schemas = crd_schemas(REPO_ROOT / "crds")
    docs = load_docs(path.read_text())
    custom = [doc for doc in docs if (doc.get("apiVersion"), doc.get("kind")) in schemas]
    assert docs, f"{path} is empty"
    for doc in custom:
        jsonschema.validate(doc, closed(schemas[(doc["apiVersion"], doc["kind"])]))


def test_closed_schema_rejects_unknown_fields():
    """The strictness the example check relies on: a misspelt field is an error, not silently pruned."""
    schema = closed(crd_schemas(REPO_ROOT / "crds")[("loraplane.dev/v1alpha1", "LoRAAdapter")])
    doc = {
        "apiVersion": "loraplane.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": "x"},
        "spec": {"bogus": 1},
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)
