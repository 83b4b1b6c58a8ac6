"""Test tiers and process-wide settings shared by every test.

Tiers (markers): default CPU tests; ``gpu`` (skipped without CUDA); ``cluster`` (skipped unless a real
cluster answers through KUBECONFIG); ``slow`` (run unless LORAPLANE_SKIP_SLOW=1).

``async def`` tests need pytest-asyncio (the dev extra). An image without it (the bare GPU image) skips them
by name instead of failing; the GPU-marked cases are plain tests around ``asyncio.run`` and run there.
"""

from __future__ import annotations

import inspect
import os

# Triton reads this when the first @triton.jit module is imported: it must be set before any import
# of loraplane.kernels. CPU machines run the kernels in Triton's interpreter.
_HAS_CUDA_DRIVER = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
if not _HAS_CUDA_DRIVER:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

try:
    import torch  # noqa: E402

    # Thread contention on 2-core machines makes tiny matmuls 50-100x slower.
    torch.set_num_threads(1)
    _CUDA = torch.cuda.is_available()
except ImportError:  # the operator-only environment has no torch
    _CUDA = False


def _cluster_reachable() -> bool:
    if not os.environ.get("KUBECONFIG"):
        return False
    try:
        from kubernetes import client, config

        config.load_kube_config(config_file=os.environ["KUBECONFIG"])
        client.VersionApi().get_code(_request_timeout=3)
        return True
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_slow = pytest.mark.skip(reason="LORAPLANE_SKIP_SLOW=1")
    skip_async = pytest.mark.skip(reason="an async test needs pytest-asyncio, not installed here")
    has_asyncio_plugin = config.pluginmanager.hasplugin("asyncio")  # pytest-asyncio's entry point name
    cluster_ok = None
    for item in items:
        if "gpu" in item.keywords and not _CUDA:
            item.add_marker(skip_gpu)
        if not has_asyncio_plugin and inspect.iscoroutinefunction(getattr(item, "obj", None)):
            item.add_marker(skip_async)
        if "slow" in item.keywords and os.environ.get("LORAPLANE_SKIP_SLOW") == "1":
            item.add_marker(skip_slow)
        if "cluster" in item.keywords:
            if cluster_ok is None:
                cluster_ok = _cluster_reachable()
            if not cluster_ok:
                item.add_marker(pytest.mark.skip(reason="no Kubernetes cluster answers through KUBECONFIG"))
