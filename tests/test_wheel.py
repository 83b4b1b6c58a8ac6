"""The wheel is what gets tested: built from this tree, installed into an empty virtual environment.

Every other test imports the source tree, where a subpackage missing from the wheel goes unnoticed. Here the
wheel is built as the images build it (pyproject.toml, README.md and src/ only), its RECORD gives the list
of modules, and an empty environment imports that list in a process of its own:
- ``engine`` extra alone (the GPU image's constraint: torch, triton, safetensors, numpy): every module under
  loraplane.engine and loraplane.kernels, with the HTTP, operator and model-hub stacks absent and the base
  install's supply-chain packages hidden;
- then the ``server`` and ``operator`` extras: every module of the package, and the ``loraplane`` command.

One environment grows from the engine extra to the server and operator extras, so torch and its CUDA
libraries (most of the time: unpacking 4 GB) are installed once; the wheels come from the package index with
the CI constraints, fetched once into a wheelhouse.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
# What the images copy into their build stage (docker/*.Dockerfile).
BUILD_INPUTS = ("pyproject.toml", "README.md", "src")
# The GPU image has torch, triton, safetensors and numpy: the engine must not need more.
NOT_IN_ENGINE_IMAGE = ("fastapi", "uvicorn", "kopf", "kubernetes", "transformers", "tokenizers", "gguf")
BASE_DEPENDENCIES = ("boto3", "botocore", "cryptography", "yaml")

IMPORT_ALL = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None  # absent, as on an image that lacks it
failed = {}
for name in json.load(sys.stdin):
    try:
        importlib.import_module(name)
    except BaseException as e:  # a module that exits or raises at import is a failure too
        failed[name] = f"{type(e).__name__}: {e}"
import loraplane
print(json.dumps({"failed": failed, "file": loraplane.__file__}))
"""


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, **kw)
    assert out.returncode == 0, (
        f"{argv[:6]} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out


def _isolated_env() -> dict[str, str]:
    """The test runner's environment without anything that points Python at the source tree."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def wheel_modules(wheel: Path) -> list[str]:
    """Every importable module in the wheel, from its RECORD (``__main__`` runs a program: left out)."""
    with zipfile.ZipFile(wheel) as z:
        (record,) = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
        rows = csv.reader(io.StringIO(z.read(record).decode()))
        paths = [row[0] for row in rows if row and row[0].endswith(".py")]
    names = []
    for path in paths:
        parts = path.removesuffix(".py").split("/")
        if parts[0] != "loraplane" or parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of exactly what the images copy (the checkout stays clean)."""
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "tree"
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            tree.mkdir(exist_ok=True)
            shutil.copy2(source, tree / name)
    dist = work / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist), str(tree)])
    (built,) = dist.glob("loraplane-*.whl")
    return built


@pytest.fixture(scope="module")
def wheelhouse(wheel, tmp_path_factory) -> Path:
    """The dependencies of every extra under test, fetched once (the engine's are a subset of the server's)."""
    house = tmp_path_factory.mktemp("wheelhouse")
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(house), "-c", str(CONSTRAINTS),
          f"{wheel}[server,operator]"], env=_isolated_env())  # fmt: skip
    yield house
    shutil.rmtree(house)  # 2.7 GB: pytest keeps its last temporary folders


@pytest.fixture
def venv_root(tmp_path):
    """Where the test's environment goes; removed afterwards (5 GB with torch and its CUDA libraries)."""
    yield tmp_path / "venv"
    shutil.rmtree(tmp_path / "venv", ignore_errors=True)


def pip_install(python: Path, requirement: str, wheelhouse: Path) -> None:
    """``pip install`` into that environment from the wheelhouse alone, under the CI constraints.

    ``--no-compile``: byte-compiling torch's and transformers' thousands of files would take minutes, and an
    import compiles what it reads anyway."""
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile", "--no-index",
          "--find-links", str(wheelhouse), "-c", str(CONSTRAINTS), requirement], env=_isolated_env())  # fmt: skip


def import_all(python: Path, names: list[str], cwd: Path, hidden: tuple[str, ...] = ()) -> dict:
    """Import ``names`` in a fresh isolated (-I) process of that environment, with ``hidden`` made absent."""
    out = _run([str(python), "-I", "-c", IMPORT_ALL, json.dumps(hidden)], input=json.dumps(names), cwd=cwd,
               env=_isolated_env())  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_source_file_is_in_the_wheel(wheel):
    """Package discovery, not a hand-written list: a new subpackage can never be left out of the wheel."""
    source = {
        ".".join(p.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "src" / "loraplane").rglob("*.py")
        if "__pycache__" not in p.parts and p.name != "__main__.py"
    }
    assert source == set(wheel_modules(wheel))


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_engine_extra_then_server_and_operator_import_every_module(wheel, wheelhouse, venv_root, tmp_path):
    """One environment, grown in two steps (torch and its CUDA libraries, most of the time, unpacked once):
    first the wheel with the ``engine`` extra alone, then the ``server`` and ``operator`` extras on top."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv_root)])  # empty: no pip, no setuptools
    python = venv_root / "bin" / "python"
    pip_install(python, f"{wheel}[engine]", wheelhouse)
    absent = _run([str(python), "-I", "-c", "import importlib.util, json, sys; print(json.dumps("
                   "[n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]))",
                   *NOT_IN_ENGINE_IMAGE], cwd=tmp_path, env=_isolated_env())  # fmt: skip
    assert json.loads(absent.stdout) == list(NOT_IN_ENGINE_IMAGE)
    engine = [n for n in wheel_modules(wheel) if n.startswith(("loraplane.engine", "loraplane.kernels"))]
    assert "loraplane.engine.parallel" in engine and "loraplane.kernels" in engine
    result = import_all(python, engine, cwd=tmp_path, hidden=BASE_DEPENDENCIES)
    assert result["failed"] == {}, "engine extra alone"
    assert Path(result["file"]).is_relative_to(venv_root)  # the wheel's copy, not the checkout

    pip_install(python, f"{wheel}[server,operator]", wheelhouse)
    result = import_all(python, wheel_modules(wheel), cwd=tmp_path)
    assert result["failed"] == {}, "server and operator extras"
    help_text = _run([str(python.parent / "loraplane"), "--help"], cwd=tmp_path, env=_isolated_env()).stdout
    for sub in ("serve", "adapter", "operator"):
        assert sub in help_text


@pytest.mark.parametrize("image, extra", [("server", "server"), ("operator", "operator")])
def test_images_install_the_wheel_with_their_extra(image, extra):
    """Each image builds the wheel from the tree and installs exactly that file with its extra, as above."""
    text = (ROOT / "docker" / f"{image}.Dockerfile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra in extras
    for name in BUILD_INPUTS:
        assert re.search(rf"(?m)^COPY .*\b{name}\b", text), f"{image}.Dockerfile does not copy {name}"
    assert re.search(r"pip wheel --no-deps --wheel-dir /wheels \.", text)
    installs = re.findall(r"pip install (?!--upgrade)(.+)", text)
    assert installs == [f'"$(ls /wheels/loraplane-*.whl)[{extra}]"'], installs
