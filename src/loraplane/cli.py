"""The ``loraplane`` console script.

Each subcommand lives in the part of the project that owns it and is imported only when used,
so ``loraplane adapter ...`` works on a machine without torch, and ``loraplane operator run``
works without the engine.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module exposing ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("loraplane.serve.main", "run the OpenAI-compatible multi-LoRA server"),
    "demo": ("loraplane.serve.demo", "run a local server on the embedded demo model with demo adapters"),
    "model": (
        "loraplane.engine.model.cli",
        "base-model tools: convert the demo model, print a base hash",
    ),
    "adapter": (
        "loraplane.artifacts.cli",
        "adapter supply chain: keygen, pack, sign, push, verify, pull",
    ),
    "operator": ("loraplane.operator.cli", "run the Kubernetes operator"),
}


def _usage() -> str:
    lines = ["usage: loraplane <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from loraplane import __version__

        print(__version__)
        return 0
    entry = SUBCOMMANDS.get(args[0])
    if entry is None:
        print(f"loraplane: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(entry[0])
    except ModuleNotFoundError as exc:
        print(f"loraplane {args[0]}: not available in this install ({exc}).", file=sys.stderr)
        return 2
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
