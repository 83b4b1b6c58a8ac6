"""``loraplane operator``: argument handling (running kopf is covered by the scenarios)."""

from __future__ import annotations

import pathlib

import pytest

from loraplane.operator import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_crds_check_through_the_cli():
    assert cli.main(["crds", "--check", str(ROOT / "crds")]) == 0


def test_run_needs_a_scope():
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["run"])
    args = cli._parser().parse_args(["run", "-n", "a", "-n", "b", "--standalone", "--metrics-port", "9090"])
    assert args.namespaces == ["a", "b"] and args.standalone and args.metrics_port == 9090
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["run", "-n", "a", "--all-namespaces"])


def test_console_script_dispatches_here(tmp_path, capsys):
    """``loraplane operator ...`` reaches this CLI: its exit codes and messages come back through."""
    from loraplane.cli import main

    assert main(["operator", "crds", "--check", str(ROOT / "crds")]) == 0
    (tmp_path / "lorabase.yaml").write_text("stale: true\n")
    assert main(["operator", "crds", "--check", str(tmp_path)]) != 0
    with pytest.raises(SystemExit) as exit_:
        main(["operator", "run"])  # the operator's own parser: a scope is required
    assert exit_.value.code == 2 and "--namespace" in capsys.readouterr().err


def test_operator_run_process_serves_liveness_and_metrics(kube_emulator):  # noqa: F811
    """The real entry point in its own process: kubeconfig by flag, liveness, metrics, SIGTERM."""
    import signal
    import subprocess
    import sys
    import urllib.request

    import yaml

    from tests.operator.harness import wait_for
    from tests.s3_servers import free_port

    for file_name in ("lorabase.yaml", "loraadapter.yaml"):
        kube_emulator.create(yaml.safe_load((ROOT / "crds" / file_name).read_text()))
    metrics_port, live_port = free_port(), free_port()
    command = [sys.executable, "-m", "loraplane.cli", "operator", "run", "--namespace", "default", "--standalone",
               "--kubeconfig", str(kube_emulator.kubeconfig_path), "--metrics-port", str(metrics_port),
               "--liveness", f"http://127.0.0.1:{live_port}/healthz"]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        get = lambda url: urllib.request.urlopen(url, timeout=2).read().decode()  # noqa: E731
        wait_for(lambda: get(f"http://127.0.0.1:{live_port}/healthz"), timeout=60, what="liveness")
        kube_emulator.create({"apiVersion": "loraplane.dev/v1alpha1", "kind": "LoRABase",
                              "metadata": {"name": "demo", "namespace": "default"},
                              "spec": {"model": {"uri": "s3://m/", "sha256": "ab" * 32}, "replicas": 0}})  # fmt: skip
        wait_for(
            lambda: kube_emulator.get("apps/v1", "Deployment", "demo"), timeout=30, what="the Deployment"
        )
        text = wait_for(
            lambda: (
                (t := get(f"http://127.0.0.1:{metrics_port}/metrics"))
                and 'loraplane_operator_reconcile_total{kind="LoRABase",result="ok"}' in t
                and t
            ),
            timeout=30,
        )
        assert "loraplane_operator_reconcile_seconds_bucket" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
    assert proc.returncode == 0, output[-3000:]
