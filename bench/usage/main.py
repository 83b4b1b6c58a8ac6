"""What metering costs the event loop: one request's record (counters, and the usage log's line) and a query.

Each case records 20,000 requests over 200 label sets through ``UsageMeter.record`` (what the event loop runs
when a request ends) and times every call; the log cases write into a temporary folder on the local disk.
Then ``GET /admin/usage``'s reader goes over the 20,000 lines.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from loraplane.http.metrics import Metrics
from loraplane.http.usage import UsageMeter
from loraplane.http.usage_log import UsageLog, UsageRecord, query

CASES = (("counters only", None), ("log, fsync off", 0.0), ("log, fsync every 1 s", 1.0),
         ("log, fsync every 10 ms", 0.01))  # fmt: skip


def _records(n: int) -> list[UsageRecord]:
    return [UsageRecord(time.time(), f"tenant-{i % 20}", f"adapter-{i % 10}", "v1", 100 + i % 50, i % 200, "ok",
                        f"chatcmpl-{i:032x}") for i in range(n)]  # fmt: skip


def _case(name: str, fsync_s: float | None, records: list[UsageRecord], folder: str) -> dict:
    metrics = Metrics()
    log = None if fsync_s is None else UsageLog(folder, fsync_interval_s=fsync_s)
    meter = UsageMeter(metrics.registry, metrics.adapter_label, top_n=100, usage_log=log)
    times = []
    started = time.perf_counter()
    for record in records:
        t0 = time.perf_counter_ns()
        meter.record(record)
        times.append(time.perf_counter_ns() - t0)
    wall = time.perf_counter() - started
    times.sort()
    row = {"case": name, "p50_us": times[len(times) // 2] / 1e3, "p99_us": times[int(len(times) * 0.99)] / 1e3,
           "max_us": times[-1] / 1e3, "mean_us": statistics.fmean(times) / 1e3,
           "records_per_s": len(records) / wall}  # fmt: skip
    if log is not None:
        t0 = time.perf_counter()
        answer = query(log, 0, tenant="tenant-3", limit=100)
        row["query_ms"] = (time.perf_counter() - t0) * 1e3
        assert answer["matched"] == len(records) // 20
        log.close()
    return row


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench/run.py usage")
    parser.add_argument("--n", type=int, default=20_000)
    args = parser.parse_args(argv)
    records = _records(args.n)
    rows = []
    for name, fsync_s in CASES:
        with tempfile.TemporaryDirectory(prefix="usage-bench-") as folder:
            rows.append(_case(name, fsync_s, records, folder))
    return {
        "title": "Token metering: the event loop's cost per request, and a usage query",
        "columns": ["case", "p50_us", "p99_us", "max_us", "mean_us", "records_per_s", "query_ms"],
        "rows": rows,
        "meta": {"records": args.n, "label sets": 200, "top_n": 100},
        "notes": ["query_ms: GET /admin/usage's reader over all the records, one tenant's (1/20) matched"],
    }
