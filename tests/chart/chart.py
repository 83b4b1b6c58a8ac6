"""Render and inspect charts/loraplane with the real helm binaries (helm v4 and helm3 from .tools/bin)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "loraplane"
CI_VALUES = CHART / "ci" / "ci-values.yaml"
TOOLS_BIN = REPO_ROOT / ".tools" / "bin"
KUBECTL = Path(sys.executable).parent / "kubectl"
RELEASE, NAMESPACE = "lp", "loraplane-system"
HELMS = {"helm4": TOOLS_BIN / "helm", "helm3": TOOLS_BIN / "helm3"}


def ensure_tools() -> dict[str, Path]:
    """The helm binaries, extracted by scripts/fetch_tools.py on first use (idempotent)."""
    if not all(path.is_file() for path in HELMS.values()):
        subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "fetch_tools.py")], check=True)
    return dict(HELMS)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys: a template that emits a label twice is a bug
    the API server would silently resolve (last one wins)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    keys = [loader.construct_object(key, deep=deep) for key, _ in node.value]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate keys {sorted(dupes)}", node.start_mark
        )
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def load_docs(text: str) -> list[dict]:
    return [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc]


@dataclass(frozen=True, slots=True)
class Rendered:
    text: str
    docs: list[dict]

    def kinds(self) -> list[str]:
        return [doc["kind"] for doc in self.docs]

    def of_kind(self, *kinds: str) -> list[dict]:
        return [doc for doc in self.docs if doc["kind"] in kinds]

    def one(self, kind: str) -> dict:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, found {len(found)}"
        return found[0]


def helm(binary: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def template(
    binary: Path,
    *value_files: Path,
    overrides: dict | None = None,
    include_crds: bool = False,
    check: bool = True,
    namespace: str = NAMESPACE,
) -> Rendered | subprocess.CompletedProcess:
    """`helm template` with the given values files, then ``overrides`` (a values dict, applied last)."""
    args = ["template", RELEASE, str(CHART), "--namespace", namespace]
    args += ["--include-crds"] if include_crds else []
    for path in value_files:
        args += ["--values", str(path)]
    with tempfile.TemporaryDirectory() as tmp:
        if overrides:
            extra = Path(tmp) / "overrides.yaml"
            extra.write_text(
                json.dumps(overrides)
            )  # JSON is YAML, and quotes every string (Go reads `y` as true)
            args += ["--values", str(extra)]
        result = helm(binary, *args, check=check)
    if not check:
        return result
    return Rendered(result.stdout, load_docs(result.stdout))


def values_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def resolve(schema: dict, node: dict) -> dict:
    """A schema node with a local ``$ref`` merged in (draft-07 ignores siblings of $ref; we keep them)."""
    if "$ref" not in node:
        return node
    target = schema
    for part in node["$ref"].removeprefix("#/").split("/"):
        target = target[part]
    return {**resolve(schema, target), **{k: v for k, v in node.items() if k != "$ref"}}


def is_string_map(node: dict) -> bool:
    return node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict)


def schema_leaves(schema: dict, node: dict | None = None, prefix: str = "") -> Iterator[tuple[str, dict]]:
    """(dotted path, node) of every value a user sets: scalars, arrays and string maps."""
    node = resolve(schema, node if node is not None else schema)
    props = node.get("properties")
    if node.get("type") != "object" or not props:
        yield prefix, node
        return
    for key, child in props.items():
        yield from schema_leaves(schema, child, f"{prefix}.{key}" if prefix else key)


def with_value(values: dict, dotted: str, value) -> dict:
    """A deep copy of ``values`` with ``dotted`` set (creating parents)."""
    out = copy.deepcopy(values)
    node = out
    *parents, last = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


def crd_schemas(folder: Path) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema for every CRD YAML in ``folder``."""
    schemas = {}
    for path in sorted(folder.glob("*.yaml")):
        for doc in load_docs(path.read_text()):
            spec = doc["spec"]
            for version in spec["versions"]:
                api_version = f"{spec['group']}/{version['name']}"
                schemas[(api_version, spec["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return schemas


def closed(schema: dict) -> dict:
    """The CRD schema as the API server's strict field validation sees it: unknown fields are errors
    (every object with properties is closed unless it preserves unknown fields)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    # metadata is the API server's business, not the CRD's.
    schema.get("properties", {}).get("metadata", {}).pop("additionalProperties", None)
    return schema


def values_table() -> str:
    """The chart README's values table, generated from values.schema.json and values.yaml.

    Regenerate with: .venv/bin/python -c "from tests.chart.chart import values_table; print(values_table())"
    """
    schema, defaults = values_schema(), yaml.safe_load((CHART / "values.yaml").read_text())
    rows = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for path, node in schema_leaves(schema):
        kind = "/".join(node["type"]) if isinstance(node.get("type"), list) else node.get("type")
        if node.get("enum"):
            kind += " (" + ", ".join(f"`{json.dumps(e) if e == '' else e}`" for e in node["enum"]) + ")"
        default = defaults
        for key in path.split("."):
            default = default[key]
        rows.append(
            f"| `{path}` | {kind} | `{json.dumps(default)}` | {node['description'].replace('|', '/')} |"
        )
    return "\n".join(rows) + "\n"
