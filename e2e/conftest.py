"""Whole-flow tests. Those marked ``cluster`` need a real Kubernetes cluster (kind or k3s) through KUBECONFIG
and are skipped cleanly when none answers (see tests/conftest.py for the tier rules)."""

from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the same tier rules as tests/)
