"""The package layout: import names map onto top-level folders, and stdlib ``operator`` stays stdlib."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags", [[], ["-S"], ["-I"]])
def test_stdlib_operator_in_a_fresh_interpreter_started_at_the_repo_root(flags):
    # -S skips site, so nothing imports the stdlib module before ./operator/ is first on sys.path.
    code = "import operator; assert not hasattr(operator, '__path__'); print(operator.eq(1, 1), operator.__file__)"
    out = subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True ") and not out.stdout.strip().startswith(str(ROOT / "operator"))


def test_import_names_map_onto_folders():
    for name, folder in [
        ("loraplane.kernels", "kernels"),
        ("loraplane.server", "server"),
        ("loraplane.operator", "operator"),
    ]:
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().parent == ROOT / folder


def test_artifacts_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "import loraplane.server.artifacts.base_hash\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_cli_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "loraplane.cli", "--help"], capture_output=True, text=True, check=True
    )
    for sub in ("serve", "adapter", "operator"):
        assert sub in out.stdout
