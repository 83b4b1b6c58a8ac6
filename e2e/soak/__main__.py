"""`python -m e2e.soak --minutes 60 --out DIR`: one soak run; exit status 0 when every check passed."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import tempfile
import time
from pathlib import Path

from e2e.soak.runner import run
from e2e.soak.schedule import CI_PLAN, Plan


def parse(argv: list[str]) -> tuple[Plan, Path, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m e2e.soak", description=__doc__)
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for report.json, soak.png, samples.json"
    )
    parser.add_argument("--ci", action="store_true", help="the short CI plan (about 4 minutes of load)")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a new temporary one)")
    defaults = Plan()
    for field in dataclasses.fields(Plan):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(getattr(defaults, field.name)), default=None,
                            help=f"default {getattr(defaults, field.name)} (CI: {getattr(CI_PLAN, field.name)})")  # fmt: skip
    args = parser.parse_args(argv)
    base = CI_PLAN if args.ci else defaults
    changes = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(Plan) if getattr(args, f.name) is not None
    }
    return dataclasses.replace(base, **changes), args.out, args.workdir


def main(argv: list[str] | None = None) -> int:
    plan, out, workdir = parse(sys.argv[1:] if argv is None else argv)
    # SIGTERM unwinds like Ctrl-C, so every process the stack started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def log(line: str) -> None:
        print(time.strftime("%H:%M:%S"), line, flush=True)

    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="loraplane-soak-") as scratch:
            report = run(plan, out, Path(scratch), log)
    else:
        report = run(plan, out, workdir, log)
    for c in report["checks"]:
        log(f"{'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['criterion']}")
    log(f"{report['verdict']}: {out / 'report.json'}")
    return 0 if report["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
