"""Benchmark runner: ``python bench/run.py AREA [--out DIR] [area args...]``.

Each area is a folder ``bench/AREA/`` with a ``main.py`` exposing ``run(argv) -> dict`` that returns
``{"title": str, "columns": [str], "rows": [dict], "meta": dict, "notes": [str]}``. The runner writes
``DIR/AREA.json`` (everything) and ``DIR/AREA.md`` (a markdown table of ``columns``), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)


def markdown(result: dict) -> str:
    cols = result["columns"]
    lines = [f"## {result['title']}", ""]
    for k, v in result.get("meta", {}).items():
        lines.append(f"- {k}: {v}")
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in result["rows"]]
    if result.get("notes"):
        lines += [""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("area", help="a folder of bench/ holding main.py")
    parser.add_argument("--out", default=".", help="folder for AREA.json and AREA.md")
    parser.add_argument("--name", default=None, help="file stem instead of AREA")
    args, rest = parser.parse_known_args(argv)
    entry = HERE / args.area / "main.py"
    if not entry.is_file():
        parser.error(f"no benchmark area {args.area!r} (expected {entry})")
    result = runpy.run_path(str(entry))["run"](rest)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or args.area
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
