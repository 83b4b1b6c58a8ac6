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


def test_the_full_pass_interval_reaches_the_quiet_checks(capsys):
    """``--full-pass-interval`` (the chart's operator.fullPassIntervalSeconds) bounds how long a settled
    adapter's drift checks may skip its Secrets and trusted keys; a bad value is refused naming the flag."""
    from loraplane.operator.context import Context

    args = cli._parser().parse_args(
        ["run", "-n", "a", "--full-pass-interval", "60", "--drift-interval", "10"]
    )
    ctx = Context(kube=None, tunables=cli.tunables_of(args))  # type: ignore[arg-type]
    assert (ctx.quiet.full_every, ctx.tunables.drift_interval) == (60.0, 10.0)
    assert Context(kube=None).quiet.full_every == 300.0  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        cli.main(["run", "-n", "a", "--full-pass-interval", "0"])
    assert "--full-pass-interval must be > 0 seconds, got 0.0" in capsys.readouterr().err


def test_a_negative_or_infinite_collect_interval_is_refused_naming_the_flag(capsys):
    assert cli._parser().parse_args(["run", "-n", "a", "--collect-interval", "0"]).collect_interval == 0.0
    with pytest.raises(SystemExit):
        cli.main(["run", "-n", "a", "--collect-interval", "-1"])
    assert "--collect-interval must be >= 0 seconds and finite, got -1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", "-n", "a", "--collect-interval", "inf"])
    assert "--collect-interval must be >= 0 seconds and finite, got inf" in capsys.readouterr().err


def test_console_script_dispatches_here(tmp_path, capsys):
    """``loraplane operator ...`` reaches this CLI: its exit codes and messages come back through."""
    from loraplane.cli import main

    assert main(["operator", "crds", "--check", str(ROOT / "crds")]) == 0
    (tmp_path / "lorabase.yaml").write_text("stale: true\n")
    assert main(["operator", "crds", "--check", str(tmp_path)]) != 0
    with pytest.raises(SystemExit) as exit_:
        main(["operator", "run"])  # the operator's own parser: a scope is required
    assert exit_.value.code == 2 and "--namespace" in capsys.readouterr().err


def test_operator_run_process_serves_liveness_and_metrics(control_plane, namespace):
    """The real entry point in its own process, as the chart's ServiceAccount: liveness, metrics, SIGTERM."""
    import signal
    import subprocess
    import sys
    import urllib.request

    from tests.operator.harness import render_operator_rbac, wait_for, wait_until_rbac_applies
    from tests.s3_servers import free_port

    rbac = render_operator_rbac(namespace)
    for doc in rbac:
        control_plane.create(doc)
    account = next(d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]["name"]
    wait_until_rbac_applies(control_plane, namespace, control_plane.service_account_token(namespace, account))
    kubeconfig = control_plane.service_account_kubeconfig(namespace, account)
    metrics_port, live_port = free_port(), free_port()
    command = [sys.executable, "-m", "loraplane.cli", "operator", "run", "--namespace", namespace, "--standalone",
               "--kubeconfig", str(kubeconfig), "--metrics-port", str(metrics_port),
               "--liveness", f"http://127.0.0.1:{live_port}/healthz"]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    failure: AssertionError | None = None
    try:
        get = lambda url: urllib.request.urlopen(url, timeout=2).read().decode()  # noqa: E731
        wait_for(lambda: get(f"http://127.0.0.1:{live_port}/healthz"), timeout=60, what="liveness")
        control_plane.create({"apiVersion": "loraplane.dev/v1alpha1", "kind": "LoRABase",
                              "metadata": {"name": "demo", "namespace": namespace},
                              "spec": {"model": {"uri": "s3://m/", "sha256": "ab" * 32}, "replicas": 0}})  # fmt: skip
        # Generous: on a loaded 2-core host kopf's start-up and first reconcile take seconds each.
        wait_for(
            lambda: control_plane.get("apps/v1", "Deployment", "demo", namespace),
            timeout=90,
            what="the Deployment",
        )
        text = wait_for(
            lambda: (
                (t := get(f"http://127.0.0.1:{metrics_port}/metrics"))
                and 'loraplane_operator_reconcile_total{kind="LoRABase",result="ok"}' in t
                and t
            ),
            timeout=60,
        )
        assert "loraplane_operator_reconcile_seconds_bucket" in text
    except AssertionError as exc:
        failure = exc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
    if failure is not None:  # what the operator said explains a wait that ran out
        raise AssertionError(f"{failure}\n--- operator output ---\n{output[-4000:]}") from failure
    assert proc.returncode == 0, output[-3000:]
