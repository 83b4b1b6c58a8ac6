"""The chart, the Dockerfiles and the operator's command line agree: the Deployment's args parse with the
real `loraplane operator run` parser behind the operator image's entrypoint."""

from __future__ import annotations

import json
import re

import pytest

from tests.chart.chart import CHART, REPO_ROOT, template

DOCKER = REPO_ROOT / "docker"


def dockerfile_exec(name: str, instruction: str) -> list[str]:
    """The exec-form (JSON) argument list of ENTRYPOINT or CMD in docker/<name>."""
    text = (DOCKER / name).read_text()
    found = re.findall(rf"(?m)^{instruction}\s+(\[.*\])\s*$", text)
    assert len(found) == 1, f"{name}: expected one exec-form {instruction}"
    return json.loads(found[0])


@pytest.mark.parametrize("values", ["default", "ci", "extra-namespaces"])
def test_deployment_args_parse_with_the_operator_cli(helm_bins, values):
    cli = pytest.importorskip("loraplane.operator.cli")
    overrides = {"watchNamespaces": ["team-a"]} if values == "extra-namespaces" else None
    files = (CHART / "ci" / "ci-values.yaml",) if values == "ci" else ()
    container = template(helm_bins["helm4"], *files, overrides=overrides).one("Deployment")
    container = container["spec"]["template"]["spec"]["containers"][0]
    assert (
        dockerfile_exec("operator.Dockerfile", "ENTRYPOINT") == ["loraplane"] and "command" not in container
    )
    assert container["args"][:2] == ["operator", "run"]
    args = cli._parser().parse_args(container["args"][1:])
    assert args.command == "run" and args.standalone
    assert args.liveness.endswith(f":{container['ports'][0]['containerPort']}/healthz")
    assert args.metrics_port == container["ports"][1]["containerPort"]
    if values == "ci":
        assert args.all_namespaces and args.verbose
    else:
        assert args.namespaces[0] == "loraplane-system" and not args.all_namespaces


def test_operator_image_default_command_parses():
    cli = pytest.importorskip("loraplane.operator.cli")
    default = dockerfile_exec("operator.Dockerfile", "CMD")
    assert default[:2] == ["operator", "run"]
    args = cli._parser().parse_args(default[1:])
    assert args.standalone and args.liveness and args.metrics_port


def test_server_image_runs_what_the_operator_passes():
    """The operator's server Deployment passes `serve <flags>` as args to the server image's entrypoint."""
    builders = pytest.importorskip("loraplane.operator.builders")
    models = pytest.importorskip("loraplane.operator.crd_models")
    from loraplane.cli import SUBCOMMANDS

    base = {
        "apiVersion": "loraplane.dev/v1alpha1",
        "kind": "LoRABase",
        "metadata": {"name": "demo", "namespace": "default", "uid": "u-1"},
        "spec": {"model": {"uri": "s3://models/demo/", "sha256": "a" * 64}},
    }
    template = builders.build_pod_template(base, models.BaseSpec.parse(base["spec"]))
    container = template["spec"]["containers"][0]
    assert "command" not in container
    assert dockerfile_exec("server.Dockerfile", "ENTRYPOINT") == ["loraplane"]
    assert container["args"][0] == "serve" in SUBCOMMANDS
    assert dockerfile_exec("server.Dockerfile", "CMD") == ["serve"]


def test_dockerfiles_run_as_non_root():
    for name, entrypoint in {
        "operator.Dockerfile": ["loraplane"],
        "server.Dockerfile": ["loraplane"],
    }.items():
        text = (DOCKER / name).read_text()
        users = re.findall(r"(?m)^USER\s+(\S+)", text)
        assert users and users[-1].split(":")[0] not in {"0", "root"}, f"{name} runs as root"
        assert users[-1].startswith("10001"), f"{name}: uid must match the chart's runAsUser 10001"
        assert dockerfile_exec(name, "ENTRYPOINT") == entrypoint
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
