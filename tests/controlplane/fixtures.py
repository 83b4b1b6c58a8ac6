"""pytest fixtures over the real control plane: one per session, a fresh namespace per test.

``control_plane`` starts etcd, kube-apiserver and kube-controller-manager once for the session (building or
reusing the binaries) with the loraplane CRDs installed, and stops them at the end. ``namespace`` gives each
test its own namespace, deleted afterwards without waiting. Import both into a conftest.py:

    from tests.controlplane.fixtures import control_plane, namespace  # noqa: F401
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controlplane.cluster import REPO_ROOT, ControlPlane

_numbers = itertools.count(1)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane.start(Path(tmp_path_factory.mktemp("controlplane")), crds=(REPO_ROOT / "crds",))
    try:
        yield plane
    finally:
        plane.stop()


def create_namespace(plane: ControlPlane, prefix: str = "t") -> str:
    name = f"{prefix}{next(_numbers)}"
    status, body = plane.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                                "metadata": {"name": name}})  # fmt: skip
    assert status == 201, body
    return name


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    name = create_namespace(control_plane)
    try:
        yield name
    finally:
        control_plane.request("DELETE", f"/api/v1/namespaces/{name}")
