"""The values contract: a strict, fully described schema; every key documented in the chart README;
and every key has an effect on the rendered manifests."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.chart.chart import (
    CHART,
    CI_VALUES,
    is_string_map,
    resolve,
    schema_leaves,
    template,
    values_schema,
    values_table,
)

# For each leaf: (a different value, other values it needs to matter). Applied on top of ci/ci-values.yaml,
# where every optional feature is on. A key missing here fails test_every_leaf_has_a_change.
CHANGES: dict[str, tuple[object, dict]] = {
    "nameOverride": ("lp-op", {}),
    "fullnameOverride": ("custom-operator", {}),
    "image.repository": ("registry.example.com/other/operator", {}),
    "image.tag": ("0.2.0", {}),
    "image.pullPolicy": ("IfNotPresent", {}),
    "imagePullSecrets": ([{"name": "other-pull-secret"}], {}),
    "serviceAccount.create": (False, {"serviceAccount": {"name": "existing-sa"}}),
    "serviceAccount.name": ("named-sa", {}),
    "serviceAccount.annotations": ({"example.com/other": "x"}, {}),
    "rbac.create": (False, {}),
    "watchAllNamespaces": (False, {}),
    "watchNamespaces": (["team-a"], {"watchAllNamespaces": False}),
    "operator.logLevel": ("info", {}),
    "operator.driftCheckIntervalSeconds": (120, {}),
    "operator.fullPassIntervalSeconds": (120, {}),
    "operator.collectIntervalSeconds": (0, {}),
    "operator.healthPort": (8081, {}),
    "metrics.port": (9191, {}),
    "routing.gatewayInferenceExtension.enabled": (True, {}),
    "resources.requests.cpu": ("250m", {}),
    "resources.requests.memory": ("192Mi", {}),
    "resources.limits.cpu": ("1", {}),
    "resources.limits.memory": ("512Mi", {}),
    "podAnnotations": ({"example.com/other": "blue"}, {}),
    "nodeSelector": ({"example.com/pool": "system"}, {}),
    "tolerations": ([{"key": "other", "operator": "Exists"}], {}),
    "priorityClassName": ("other-priority", {}),
    "serviceMonitor.enabled": (False, {}),
    "serviceMonitor.interval": ("1m", {}),
    "serviceMonitor.labels": ({"release": "other"}, {}),
    "serverImage.repository": ("registry.example.com/other/server", {}),
    "serverImage.tag": ("0.2.0", {}),
    "exampleBase.enabled": (False, {}),
    "exampleBase.name": ("other-base", {}),
    "exampleBase.model.uri": ("s3://models/other/", {}),
    "exampleBase.model.sha256": ("b" * 64, {}),
    "exampleBase.replicas": (3, {}),
    "exampleBase.tensorParallelSize": (4, {}),
    "exampleBase.gpus": (0, {}),
    "exampleBase.storage.endpoint": ("https://s3.example.com", {}),
    "operator.policy.allowedS3Endpoints": (["https://s3.other.example.com"], {}),
    "operator.policy.hostPathPrefix": ("/srv/loraplane", {}),
    "operator.policy.allowedRegistries": (["registry.other.example.com/ml"], {}),
    "operator.policy.pinServerImage": (False, {}),
    "operator.policy.allowedTolerations": (["other-taint"], {}),
    "operator.policy.allowedNodeLabels": (["example.com/pool"], {}),
    "operator.policy.allowedPriorityClasses": (["other-priority"], {}),
    "operator.policy.allowedServiceAccounts": (["other-reader"], {}),
    "operator.policy.allowedRuntimeClasses": (["gvisor"], {}),
    "exampleBase.storage.region": ("eu-west-1", {}),
    "exampleBase.storage.credentialsSecret": ("other-s3-credentials", {}),
    "exampleBase.trustedKeysSecret": ("other-signing-keys", {}),
}
# Keys that are no-ops by design (none today); each entry must say why.
NO_OP_BY_DESIGN: dict[str, str] = {}


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def leaf_paths() -> list[str]:
    schema = values_schema()
    return [path for path, _ in schema_leaves(schema)]


def test_every_leaf_has_a_change():
    assert set(leaf_paths()) == set(CHANGES) | set(NO_OP_BY_DESIGN)


def test_schema_is_strict_and_described():
    schema = values_schema()

    def walk(node: dict, path: str) -> None:
        node = resolve(schema, node)
        assert node.get("description"), f"{path or '<root>'} has no description"
        if node.get("type") == "object" and not is_string_map(node):
            assert node.get("additionalProperties") is False, f"{path or '<root>'} is not closed"
            for key, child in node.get("properties", {}).items():
                walk(child, f"{path}.{key}" if path else key)
        if node.get("type") == "array":
            walk(node["items"], f"{path}[]")

    schema = {**schema, "description": schema.get("title")}
    walk(schema, "")


def test_values_yaml_matches_schema_keys():
    """values.yaml sets every schema leaf (the defaults live in one place) and nothing else."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def paths(node: dict, prefix: str = "") -> set[str]:
        out = set()
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else key
            is_branch = isinstance(value, dict) and value and path not in CHANGES
            out |= paths(value, path) if is_branch else {path}
        return out

    assert paths(values) == set(leaf_paths())


def test_readme_documents_every_key():
    readme = (CHART / "README.md").read_text()
    missing = [path for path in leaf_paths() if f"| `{path}` |" not in readme]
    assert not missing, f"charts/loraplane/README.md lacks {missing}"
    assert values_table() in readme, (
        "charts/loraplane/README.md's values table is stale; regenerate it with "
        '.venv/bin/python -c "from tests.chart.chart import values_table; print(values_table())"'
    )


@pytest.fixture(scope="module")
def ci_values() -> dict:
    return yaml.safe_load(CI_VALUES.read_text())


@pytest.mark.parametrize("path", sorted(CHANGES))
def test_each_value_has_an_effect(helm_bins, ci_values, path):
    value, context = CHANGES[path]
    base = merge(ci_values, context)
    before = _render_cached(helm_bins["helm4"], base)
    changed = merge(base, _nested(path, value))
    after = template(helm_bins["helm4"], overrides=changed).text
    assert changed != base, f"CHANGES[{path!r}] equals the CI value; pick another"
    assert before != after, f"setting {path} to {value!r} changed nothing in the rendered chart"


_RENDERS: dict[str, str] = {}


def _render_cached(binary, values: dict) -> str:
    """Most cases share the same base values; render each distinct base once."""
    key = json.dumps(values, sort_keys=True)
    if key not in _RENDERS:
        _RENDERS[key] = template(binary, overrides=values).text
    return _RENDERS[key]


def _nested(dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    out = {last: value}
    for key in reversed(parents):
        out = {key: out}
    return out
