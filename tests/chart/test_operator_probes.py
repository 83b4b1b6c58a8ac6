"""The chart's probes and metrics port point at what the operator really serves: run `loraplane operator
run` with the Deployment's rendered args against the real API server, then GET /healthz and /metrics."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.chart.chart import template

LORAPLANE = Path(sys.executable).with_name("loraplane")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, deadline: float) -> bytes:
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"the operator exited ({proc.returncode}):\n{proc.communicate()[0][-3000:]}"
        )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                assert response.status == 200
                return response.read()
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url} did not answer in time")


@pytest.mark.slow
def test_probes_and_metrics_answer(control_plane, namespace, helm_bins):
    pytest.importorskip("kopf")
    ports = {"operator": {"healthPort": free_port()}, "metrics": {"port": free_port()}}
    rendered = template(helm_bins["helm4"], overrides=ports, namespace=namespace)
    for doc in rendered.of_kind("ServiceAccount", "Role", "RoleBinding"):
        control_plane.create(doc)
    container = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    # What the container runs: the image's entrypoint (`loraplane`) with the Deployment's args, with the
    # token its ServiceAccount would get.
    account = rendered.one("ServiceAccount")["metadata"]["name"]
    kubeconfig = control_plane.service_account_kubeconfig(namespace, account)
    command = [str(LORAPLANE), *container["args"], "--kubeconfig", str(kubeconfig)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        probe = container["livenessProbe"]["httpGet"]
        assert probe == container["readinessProbe"]["httpGet"]
        wait_for(f"http://127.0.0.1:{ports['operator']['healthPort']}{probe['path']}", proc, deadline)
        metrics = wait_for(f"http://127.0.0.1:{ports['metrics']['port']}/metrics", proc, deadline)
        assert b"# TYPE loraplane_operator_reconcile" in metrics  # the operator's own metrics
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
