"""On an external cluster (KUBECONFIG): the CRDs install, and its schema validation (patterns, enums, CEL rules)
refuses malformed custom resources with the field named. tests/operator/test_crds_server.py checks the same on
the tests' own control plane."""

from __future__ import annotations

import copy
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.cluster


def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["kubectl", f"--kubeconfig={os.environ['KUBECONFIG']}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def namespace():
    kubectl("apply", "-f", str(ROOT / "crds"))
    for crd in ("lorabases.loraplane.dev", "loraadapters.loraplane.dev"):
        assert kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s").returncode == 0
    name = f"loraplane-e2e-{uuid.uuid4().hex[:6]}"
    assert kubectl("create", "namespace", name).returncode == 0
    yield name
    kubectl("delete", "namespace", name, "--wait=false")


def _example(kind: str) -> dict:
    for path in (ROOT / "examples").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind:
                doc["metadata"].pop("namespace", None)
                return doc
    raise AssertionError(f"no {kind} in examples/")


def test_examples_are_accepted(namespace):
    for kind in ("LoRABase", "LoRAAdapter"):
        out = kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(_example(kind)))
        assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("spec", "source", "uri"), "https://example.com/a/", "spec.source.uri"),
        (("metadata", "name"), "Bad_Name", "metadata.name"),
        (("spec", "rollout", "maxUnavailable"), -1, "spec.rollout.maxUnavailable"),
    ],
)
def test_malformed_adapter_is_refused_naming_the_field(namespace, path, value, field):
    doc = copy.deepcopy(_example("LoRAAdapter"))
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    out = kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc))
    assert out.returncode != 0
    assert field.split(".")[-1] in out.stderr
