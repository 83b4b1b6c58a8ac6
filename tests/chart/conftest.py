"""Fixtures for the chart checks: the helm binaries (extracted on demand) and the real control plane."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chart.chart import CI_VALUES, ensure_tools
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.fixtures import control_plane, namespace  # noqa: F401


@pytest.fixture(scope="module")
def bare_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A control plane of its own with no CRDs yet, as a cluster is before the chart's first install: helm
    installs the CRDs itself (helm 4 server-side applies them, and refuses CRDs another manager owns)."""
    plane = ControlPlane.start(tmp_path_factory.mktemp("bare-cluster"))
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def helm_bins() -> dict[str, Path]:
    return ensure_tools()


@pytest.fixture(scope="session", params=["helm4", "helm3"])
def helm_bin(request, helm_bins) -> Path:
    return helm_bins[request.param]


@pytest.fixture(scope="session", params=["default", "ci"])
def values_files(request) -> tuple[Path, ...]:
    return () if request.param == "default" else (CI_VALUES,)
