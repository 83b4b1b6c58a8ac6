"""Whole-flow tests. The scenarios run on the tests' own control plane (tests/controlplane) with the kubelet
stand-in; those marked ``cluster`` need an external cluster through KUBECONFIG and are skipped cleanly when none
answers (see tests/conftest.py for the tier rules)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.stack import Stack, build_stack
from loraplane.artifacts.base_hash import compute_base_hash
from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the same tier rules as tests/)
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.fixtures import create_namespace
from tests.http.conftest import tiny_chat_model_dir  # noqa: F401
from tests.s3_servers import moto_server


@pytest.fixture(scope="session")
def fresh_cluster(tmp_path_factory) -> Iterator[ControlPlane]:
    """A control plane of its own with no CRDs: `helm install` puts them there, as on a new cluster."""
    plane = ControlPlane.start(tmp_path_factory.mktemp("e2e-cluster"))
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def stack(fresh_cluster, tiny_chat_model_dir, tmp_path_factory) -> Iterator[Stack]:  # noqa: F811
    """One namespace with the chart installed by helm, its operator Pod running, S3 holding the tiny base."""
    namespace = create_namespace(fresh_cluster, "e2e")
    with moto_server() as s3:
        built = build_stack(fresh_cluster, namespace, tmp_path_factory.mktemp("e2e"), s3, tiny_chat_model_dir,
                            compute_base_hash(tiny_chat_model_dir))  # fmt: skip
        try:
            built.install_chart()
            fresh_cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
            built.start_kubelet()
            yield built
        finally:
            built.stop()
