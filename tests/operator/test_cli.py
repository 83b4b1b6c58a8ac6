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


def test_console_script_dispatches_here():
    from loraplane.cli import SUBCOMMANDS

    assert SUBCOMMANDS["operator"][0] == "loraplane.operator.cli"
