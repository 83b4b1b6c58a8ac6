"""What the operator keeps per replaced server Pod: the soak's world with one server Pod, replaced again and
again, the operator's RSS read after each replacement has settled (and, with ``--trace``, a tracemalloc diff
dumped by the operator itself: ``operator/memtrace.py``).

    python -m e2e.soak.memprobe --replacements 12 --out DIR [--trace] [--env K=V ...]

``DIR/probe.json``: RSS and fds of the operator after each replacement; ``DIR/trace.txt``: the diffs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from e2e.soak.world import (
    BASE,
    CANARY,
    adapter_names,
    adapters_converged,
    is_ready,
    operator_pods,
    proc_sample,
    publish,
    running_processes,
    started_stack,
    wait_base,
    wait_operator_ready,
)
from e2e.stack import wait_for


def _operator_pid(stack) -> int:
    name = next(p["metadata"]["name"] for p in operator_pods(stack) if is_ready(p))
    return running_processes(stack)[name]


def _replace(stack, expected: dict[str, str], bound: float) -> float:
    """Kill the one server Pod; seconds until its replacement serves every adapter."""
    victim = stack.server_pods(BASE)[0]["metadata"]["name"]
    began = time.monotonic()
    stack.kubelet.kill(victim)

    def done() -> bool:
        pods = [p for p in stack.ready_pods(BASE) if p["metadata"]["name"] != victim]
        return bool(pods) and not adapters_converged(stack, expected)

    wait_for(done, bound, "the replacement Pod serving every adapter", interval=1)
    return round(time.monotonic() - began, 1)


def _rss_split(pid: int) -> dict[str, float]:
    """RssAnon (the heaps: what fragmentation or a leak grows) and RssFile (mapped code and files) in MiB."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {f"{key.lower()}_mib": round(int(fields[key].split()[0]) / 1024, 2)
            for key in ("RssAnon", "RssFile") if key in fields}  # fmt: skip


def probe(out: Path, workdir: Path, replacements: int, settle_s: float, trace: bool, adapters: int,
          extra: dict[str, str]) -> dict:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    trace_file = out / "trace.txt"
    env = {**extra, "LORAPLANE_TRACEMALLOC": str(trace_file)} if trace else dict(extra)
    rows = []
    with started_stack(workdir, env=env) as stack:
        wait_operator_ready(stack)
        wait_base(stack, 1, timeout=600)
        names = [*adapter_names(adapters), CANARY]
        stack.apply(*[publish(stack, n, "v1", seed=i) for i, n in enumerate(names)])
        expected = dict.fromkeys(names, "v1")
        wait_for(lambda: not adapters_converged(stack, expected), 600, "the first convergence", interval=2)
        pid = _operator_pid(stack)
        for k in range(replacements + 1):
            took = _replace(stack, expected, 300) if k else 0.0
            time.sleep(settle_s)  # idle connections closed (keep-alive), Events posted
            if trace:
                os.kill(pid, signal.SIGUSR1)
                time.sleep(3)
            sample = proc_sample(pid) or {}
            rss_mib = round(sample.get("rss", 0) / 2**20, 2)
            rows.append({"replacement": k, "converged_s": took, "rss_mib": rss_mib, **_rss_split(pid),
                         "fds": sample.get("fds"), "threads": sample.get("threads"), "cpu_s": sample.get("cpu_s")})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    report = {"rows": rows, "env": extra, "trace": str(trace_file) if trace else None}
    (out / "probe.json").write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.soak.memprobe")
    parser.add_argument("--replacements", type=int, default=10)
    parser.add_argument("--settle", type=float, default=25.0, help="seconds after each convergence")
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--trace", action="store_true", help="the operator dumps tracemalloc diffs")
    parser.add_argument("--env", action="append", default=[], metavar="K=V",
                        help="more environment for every Pod's process, e.g. MALLOC_ARENA_MAX=2 (repeatable)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    extra = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env: expected K=V, got {item!r}")
        extra[key] = value
    with tempfile.TemporaryDirectory(prefix="memprobe-") as workdir:
        probe(args.out, Path(workdir), args.replacements, args.settle, args.trace, args.adapters, extra)


if __name__ == "__main__":
    main()
