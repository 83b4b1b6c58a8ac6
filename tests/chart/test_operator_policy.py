"""The chart's `operator.policy` values become exactly the operator's policy: render the Deployment, parse its
args with the operator's own command line, and compare the policy it builds with the values."""

from __future__ import annotations

import pytest
import yaml

from loraplane.operator.cli import _parser, policy_of
from loraplane.operator.policy import OperatorPolicy
from tests.chart.chart import CHART, template


def _policy(rendered) -> OperatorPolicy:
    args = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["operator", "run"]
    return policy_of(_parser().parse_args(args[1:]))


def test_default_values_allow_aws_the_project_registry_and_gpu_placement_only(helm_bins):
    policy = _policy(template(helm_bins["helm4"]))
    gpu_placement = {"allowed_tolerations": ("nvidia.com/gpu",),
                     "allowed_node_labels": ("nvidia.com/gpu.present", "nvidia.com/gpu.product")}  # fmt: skip
    assert policy == OperatorPolicy(**gpu_placement)
    assert (
        policy.allowed_s3_endpoints == () and policy.host_path_prefix is None and policy.server_image is None
    )
    assert not (
        policy.allowed_priority_classes or policy.allowed_service_accounts or policy.allowed_runtime_classes
    )
    example = yaml.safe_load((CHART.parent.parent / "examples" / "lorabase.yaml").read_text())
    policy.check_placement(example["spec"])  # the example's GPU nodeSelector and toleration pass


def test_ci_values_reach_the_operator(helm_bins):
    values = yaml.safe_load((CHART / "ci" / "ci-values.yaml").read_text())
    rendered = template(helm_bins["helm4"], CHART / "ci" / "ci-values.yaml")
    policy = _policy(rendered)
    want = values["operator"]["policy"]
    assert policy.allowed_s3_endpoints == tuple(want["allowedS3Endpoints"])
    assert policy.host_path_prefix == want["hostPathPrefix"]
    assert policy.allowed_registries == tuple(want["allowedRegistries"])
    for value, field_ in (("allowedTolerations", "allowed_tolerations"), ("allowedNodeLabels", "allowed_node_labels"),
                          ("allowedPriorityClasses", "allowed_priority_classes"),
                          ("allowedServiceAccounts", "allowed_service_accounts"),
                          ("allowedRuntimeClasses", "allowed_runtime_classes")):  # fmt: skip
        assert getattr(policy, field_) == tuple(want[value]), value
    server = values["serverImage"]
    assert policy.server_image == f"{server['repository']}:{server['tag']}"  # pinServerImage: true
    example = rendered.one("LoRABase")
    assert policy.server_image_for(example["spec"]["image"], "") == policy.server_image
    policy.check_endpoint(example["spec"]["storage"]["endpoint"])  # the example base keeps the rules


@pytest.mark.parametrize("prefix", ["/", "/var/../etc", "relative/path", "/var/cache/"])
def test_schema_refuses_a_host_path_prefix_the_operator_would(helm_bins, prefix):
    result = template(
        helm_bins["helm4"], overrides={"operator": {"policy": {"hostPathPrefix": prefix}}}, check=False
    )
    assert result.returncode != 0 and "hostPathPrefix" in result.stderr
    if prefix in ("/", "relative/path"):
        with pytest.raises(ValueError, match="host-path-prefix"):
            OperatorPolicy(host_path_prefix=prefix)
    else:  # the flag is forgiving where the chart is strict: it normalises, and never to the root
        assert OperatorPolicy(host_path_prefix=prefix).host_path_prefix in ("/etc", "/var/cache")
