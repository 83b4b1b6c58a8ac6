"""Security and hygiene rules on the rendered chart, checked for every values profile and both helms."""

from __future__ import annotations

import re

import pytest

from tests.chart.chart import CHART, helm, load_docs, template

PROFILES = {
    "default": {},
    "ci": None,  # ci/ci-values.yaml
    "extra-namespaces": {"watchNamespaces": ["team-a", "team-b"]},
}


@pytest.fixture(scope="module", params=sorted(PROFILES))
def rendered(request, helm_bins):
    overrides = PROFILES[request.param]
    if overrides is None:
        return template(helm_bins["helm4"], CHART / "ci" / "ci-values.yaml")
    return template(helm_bins["helm4"], overrides=overrides)


def rbac_rules(rendered) -> list[tuple[str, dict]]:
    return [
        (f"{doc['kind']}/{doc['metadata'].get('namespace', '')}", rule)
        for doc in rendered.of_kind("Role", "ClusterRole")
        for rule in doc["rules"]
    ]


def test_rbac_never_grants_pods_exec_or_wildcards(rendered):
    assert rbac_rules(rendered), "no RBAC rendered"
    for where, rule in rbac_rules(rendered):
        resources, verbs = rule.get("resources", []), rule["verbs"]
        assert "*" not in resources and "*" not in verbs and "*" not in rule.get("apiGroups", []), where
        # pods/status patch only (the server pods' readiness gate); never exec, attach, portforward, eviction...
        pods_sub = [r for r in resources if r.startswith("pods/")]
        assert pods_sub in ([], ["pods/status"]), f"{where} grants {resources}"
        assert not pods_sub or set(verbs) == {"patch"}, f"{where} grants {verbs} on {pods_sub}"
        assert "escalate" not in verbs and "bind" not in verbs and "impersonate" not in verbs, where


def test_secrets_are_read_by_name_only(rendered):
    secret_rules = [(where, rule) for where, rule in rbac_rules(rendered) if "secrets" in rule["resources"]]
    assert secret_rules
    for where, rule in secret_rules:
        # get by name, and create for the admin token; never list/watch (enumerate) nor change others'.
        assert set(rule["verbs"]) <= {"get", "create"}, f"{where} secrets verbs {rule['verbs']}"


def test_pods_read_only(rendered):
    for where, rule in rbac_rules(rendered):
        if "pods" in rule["resources"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, where


def test_roles_bind_only_the_operator_service_account(rendered):
    sa = rendered.one("ServiceAccount")["metadata"]["name"]
    for binding in rendered.of_kind("RoleBinding", "ClusterRoleBinding"):
        assert [s["name"] for s in binding["subjects"]] == [sa]
        assert binding["roleRef"]["name"] == binding["metadata"]["name"]


def test_pods_run_as_non_root_hardened(rendered):
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert container["resources"]["requests"] and container["resources"]["limits"]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["port"] == "health"
        assert {p["name"] for p in container["ports"]} == {"health", "metrics"}


def test_no_latest_or_untagged_images(rendered):
    images = re.findall(r"""(?m)^\s*image:\s*["']?([^"'\s]+)""", rendered.text)
    assert images
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"{image} has no tag"
        assert tag.lower() != "latest", image


def test_default_image_tags_follow_app_version(helm_bins):
    chart = (CHART / "Chart.yaml").read_text()
    app_version = re.search(r'(?m)^appVersion:\s*"?([^"\s]+)', chart).group(1)
    rendered = template(helm_bins["helm4"], overrides={"exampleBase": {"enabled": True, "model": {
        "uri": "s3://m/", "sha256": "a" * 64}}})  # fmt: skip
    assert rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(
        f":{app_version}"
    )
    assert rendered.one("LoRABase")["spec"]["image"].endswith(f"-server:{app_version}")


@pytest.mark.parametrize("tag", ["latest", "LATEST", "Latest"])
def test_schema_refuses_latest(helm_bin, tag):
    for key in ("image", "serverImage"):
        result = template(helm_bin, overrides={key: {"tag": tag}}, check=False)
        assert result.returncode != 0 and "tag" in result.stderr, result.stderr


def test_schema_refuses_unknown_keys_at_every_level(helm_bin):
    for overrides in ({"bogus": 1}, {"image": {"bogus": 1}}, {"exampleBase": {"storage": {"bogus": 1}}}):
        result = template(helm_bin, overrides=overrides, check=False)
        assert result.returncode != 0 and "bogus" in result.stderr, result.stderr


def test_contradictory_values_fail_with_a_message(helm_bins):
    result = template(
        helm_bins["helm4"], overrides={"watchAllNamespaces": True, "watchNamespaces": ["a"]}, check=False
    )
    assert result.returncode != 0 and "watchNamespaces must be empty" in result.stderr
    result = template(helm_bins["helm4"], overrides={"exampleBase": {"enabled": True}}, check=False)
    assert result.returncode != 0 and "exampleBase.model.uri is required" in result.stderr
    result = template(helm_bins["helm4"], overrides={"serviceAccount": {"create": False}}, check=False)
    assert result.returncode != 0 and "serviceAccount.name is required" in result.stderr


def test_long_names_truncate_to_63(helm_bins):
    out = helm(helm_bins["helm4"], "template", "r" * 53, str(CHART))  # helm caps release names at 53
    for doc in load_docs(out.stdout):
        assert len(doc["metadata"]["name"]) <= 63
        assert not doc["metadata"]["name"].endswith("-")
