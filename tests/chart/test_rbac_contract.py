"""The chart grants exactly what the operator says it needs: the table in docs/operator.md
("RBAC (for the chart)") and the chart's Role/ClusterRole rules must agree, row for row."""

from __future__ import annotations

import re

import pytest

from tests.chart.chart import CHART, REPO_ROOT, template

OPERATOR_DOC = REPO_ROOT / "docs" / "operator.md"
# Rows the doc lists that the chart deliberately leaves out, and why.
NOT_GRANTED = {
    ("kopf.dev", "kopfpeerings"): "the chart runs the operator --standalone (one replica, no peering)",
    ("kopf.dev", "clusterkopfpeerings"): "the chart runs the operator --standalone (one replica, no peering)",
    ("", "namespaces"): (
        "kopf 1.45 lists and watches namespaces only when it is not cluster-wide and scanning is on "
        "(kopf/_core/reactor/observation.py, namespace_observer); the operator is either cluster-wide or "
        "has scanning off"
    ),
}
Grant = tuple[str, str, frozenset[str]]  # (apiGroup, resource, verbs)
# Rules the chart adds beyond the doc's table, and why (none: the doc lists every rule the chart grants).
EXTRA_GRANTED: dict[Grant, str] = {}


ROUTING_ONLY = "only with `routing.gatewayInferenceExtension.enabled`"


def doc_rows() -> list[tuple[Grant, bool]]:
    """(grant, cluster-wide only) for each row of the operator doc's RBAC table that grants verbs (the rows
    marked ROUTING_ONLY are routing_rows')."""
    return [(grant, cluster) for grant, cluster, routing in _rows() if not routing]


def routing_rows() -> list[Grant]:
    return [grant for grant, _, routing in _rows() if routing]


def _rows() -> list[tuple[Grant, bool, bool]]:
    text = OPERATOR_DOC.read_text()
    section = text.split("## RBAC (for the chart)", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        group = cells[0].strip("`").replace('""', "")
        verbs = frozenset(v.strip() for v in cells[2].split(",") if v.strip() not in {"", "—", "-"})
        for resource in re.findall(r"`([^`]+)`", cells[1]):
            if verbs:
                rows.append(
                    ((group, resource, verbs), "cluster-wide only" in cells[3], ROUTING_ONLY in cells[3])
                )
    return rows


def chart_grants(rendered, kind: str) -> set[Grant]:
    grants = set()
    for role in rendered.of_kind(kind):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    grants.add((group, resource, frozenset(rule["verbs"])))
    return grants


@pytest.mark.skipif(
    not OPERATOR_DOC.exists(), reason="docs/operator.md (the operator's RBAC needs) is missing"
)
@pytest.mark.parametrize("routing", [False, True], ids=["no-routing", "routing"])
@pytest.mark.parametrize("cluster_wide", [False, True], ids=["Role", "ClusterRole"])
def test_chart_rbac_matches_the_operator_doc(helm_bins, cluster_wide, routing):
    rows = doc_rows() + [(grant, False) for grant in (routing_rows() if routing else [])]
    assert rows, "docs/operator.md has no RBAC table"
    overrides = {
        "watchAllNamespaces": cluster_wide,
        "routing": {"gatewayInferenceExtension": {"enabled": routing}},
    }
    rendered = template(helm_bins["helm4"], overrides=overrides)
    args = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--standalone" in args  # what NOT_GRANTED relies on
    assert ("--gateway-inference-extension" in args) == routing
    want = {
        grant
        for grant, cluster_only in rows
        if (cluster_wide or not cluster_only) and grant[:2] not in NOT_GRANTED
    } | set(EXTRA_GRANTED)
    have = chart_grants(rendered, "ClusterRole" if cluster_wide else "Role")
    missing, extra = want - have, have - want
    assert not missing, f"the chart lacks what docs/operator.md needs: {sorted(missing)}"
    assert not extra, f"the chart grants what docs/operator.md does not list: {sorted(extra)}"


def test_chart_readme_lists_the_same_rules():
    readme = (CHART / "README.md").read_text()
    for (group, resource, verbs), _ in doc_rows() + [(grant, False) for grant in routing_rows()]:
        if (group, resource) in NOT_GRANTED:
            continue
        row = next((line for line in readme.splitlines() if f"`{resource}`" in line and "|" in line), None)
        assert row is not None, f"charts/loraplane/README.md's RBAC table lacks {resource}"
        assert all(verb in row for verb in verbs), f"README row for {resource} lacks {sorted(verbs)}"
