"""The chart, the Dockerfiles and the operator's command line agree: the Deployment's args parse with the
real `loraplane operator run` parser behind the operator image's entrypoint."""

from __future__ import annotations

import json
import re

import pytest

from tests.chart.chart import CHART, REPO_ROOT, template

DOCKER = REPO_ROOT / "docker"


def dockerfile_entrypoint(name: str) -> list[str]:
    text = (DOCKER / name).read_text()
    found = re.findall(r"(?m)^ENTRYPOINT\s+(\[.*\])\s*$", text)
    assert len(found) == 1, f"{name}: expected one exec-form ENTRYPOINT"
    return json.loads(found[0])


@pytest.mark.parametrize("values", ["default", "ci", "extra-namespaces"])
def test_deployment_args_parse_with_the_operator_cli(helm_bins, values):
    cli = pytest.importorskip("loraplane.operator.cli")
    overrides = {"watchNamespaces": ["team-a"]} if values == "extra-namespaces" else None
    files = (CHART / "ci" / "ci-values.yaml",) if values == "ci" else ()
    container = template(helm_bins["helm4"], *files, overrides=overrides).one("Deployment")
    container = container["spec"]["template"]["spec"]["containers"][0]
    entrypoint = dockerfile_entrypoint("operator.Dockerfile")
    assert entrypoint[:3] == ["loraplane", "operator", "run"] and "command" not in container
    args = cli._parser().parse_args([*entrypoint[2:], *container["args"]])
    assert args.command == "run" and args.standalone
    assert args.liveness.endswith(f":{container['ports'][0]['containerPort']}/healthz")
    assert args.metrics_port == container["ports"][1]["containerPort"]
    if values == "ci":
        assert args.all_namespaces and args.verbose
    else:
        assert args.namespaces[0] == "loraplane-system" and not args.all_namespaces


def test_dockerfiles_run_as_non_root():
    for name, entrypoint in {
        "operator.Dockerfile": ["loraplane", "operator", "run"],
        "server.Dockerfile": ["loraplane", "serve"],
    }.items():
        text = (DOCKER / name).read_text()
        users = re.findall(r"(?m)^USER\s+(\S+)", text)
        assert users and users[-1].split(":")[0] not in {"0", "root"}, f"{name} runs as root"
        assert users[-1].startswith("10001"), f"{name}: uid must match the chart's runAsUser 10001"
        assert dockerfile_entrypoint(name) == entrypoint
        assert ":latest" not in text, f"{name} uses a latest base image"


def test_dockerignore_keeps_build_context_small():
    ignored = set((REPO_ROOT / ".dockerignore").read_text().split())
    assert {".venv/", ".git/", ".tools/", "tests/"} <= ignored


def test_chart_app_version_is_the_package_version():
    """Images are tagged with the package version and the chart defaults to appVersion: they must agree."""
    import tomllib

    import loraplane

    chart = (CHART / "Chart.yaml").read_text()
    app_version = re.search(r'(?m)^appVersion:\s*"?([^"\s]+)"?', chart).group(1)
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert app_version == project["version"] == loraplane.__version__
