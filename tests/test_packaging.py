"""The package layout: the import tree is the src/ tree."""

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_names_are_the_src_tree():
    for name in (
        "loraplane.kernels",
        "loraplane.artifacts",
        "loraplane.engine",
        "loraplane.http",
        "loraplane.serve",
        "loraplane.operator",
    ):
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().parent == ROOT / "src" / Path(*name.split("."))


def test_artifacts_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "import loraplane.artifacts.base_hash\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_engine_imports_without_an_s3_client():
    """Remote adapters reach the engine as a fetch callable: the engine itself never needs boto3."""
    code = (
        "import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
        "import loraplane.engine.core.async_engine, loraplane.engine.lora.manager, loraplane.engine.lora.remote\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_cli_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "loraplane.cli", "--help"], capture_output=True, text=True, check=True
    )
    for sub in ("serve", "adapter", "operator"):
        assert sub in out.stdout
