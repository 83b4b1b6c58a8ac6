"""``loraplane model``: convert the demo model, print a model folder's base hash."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplane model", description="Base-model utilities.")
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert-demo", help="convert the SmolLM2-135M-Instruct GGUF into an HF folder")
    convert.add_argument("--out", help="target folder (default: the cache, $LORAPLANE_CACHE/models/<sha>)")
    hashing = sub.add_parser("hash", help="print the base hash of an HF folder's safetensors weights")
    hashing.add_argument("dir", help="model folder holding *.safetensors")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "hash":
        from loraplane.artifacts.base_hash import BaseHashError, compute_base_hash

        try:
            print(compute_base_hash(args.dir))
        except (BaseHashError, OSError) as exc:
            print(f"loraplane model hash: {exc}", file=sys.stderr)
            return 1
        return 0
    from loraplane.engine.model.demo_model import DemoModelError, ensure_demo_model

    try:
        print(ensure_demo_model(args.out))
    except DemoModelError as exc:
        print(f"loraplane model convert-demo: {exc}", file=sys.stderr)
        return 1
    return 0
