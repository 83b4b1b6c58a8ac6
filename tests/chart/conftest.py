"""Fixtures for the chart checks: the helm binaries (extracted on demand) and the Kubernetes API emulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chart.chart import CI_VALUES, ensure_tools
from tests.kube.fixtures import kube_emulator  # noqa: F401


@pytest.fixture(scope="session")
def helm_bins() -> dict[str, Path]:
    return ensure_tools()


@pytest.fixture(scope="session", params=["helm4", "helm3"])
def helm_bin(request, helm_bins) -> Path:
    return helm_bins[request.param]


@pytest.fixture(scope="session", params=["default", "ci"])
def values_files(request) -> tuple[Path, ...]:
    return () if request.param == "default" else (CI_VALUES,)
