"""One soak run: start the world, converge, run load + version bumps + canary + faults for the planned time,
stop the load, wait for the final convergence, judge, and write ``report.json`` and ``soak.png`` into ``out``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from e2e.soak import verdict as V
from e2e.soak.load import Clients, Endpoints, Ledger, Tally
from e2e.soak.monitor import Monitor, Sampler
from e2e.soak.plot import plot
from e2e.soak.schedule import Faults, Plan, Roller
from e2e.soak.world import (
    CANARY,
    adapter_names,
    base_model_name,
    cache_litter,
    host_cache_dirs,
    publish,
    started_stack,
    wait_base,
    wait_operator_ready,
)
from e2e.stack import wait_for

SETUP_BOUND = 600.0
PARTIAL_EVERY_S = 300.0  # a long run writes report.partial.json (checks so far) this often
IN_PROGRESS = {
    "converged": False,
    "waited_s": 0,
    "lagging": ["the run is still in progress"],
    "caches": {},
}  # the first convergence: 21 adapters pulled, loaded and warmed on two CPU Pods


def run(plan: Plan, out: Path, workdir: Path, log=print, plane=None, model_dir: Path | None = None) -> dict:
    """The soak on ``plane`` (default: a control plane of its own), serving ``model_dir`` (default: the tiny
    Llama built here); the report, also written into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with started_stack(workdir, plane, model_dir) as stack:
        wait_operator_ready(stack)
        pods = wait_base(stack, plan.replicas, timeout=SETUP_BOUND)
        base_model = base_model_name(pods[0])
        names = adapter_names(plan.adapters)
        log(f"base Pods Ready; publishing {len(names)} adapters and the canary")
        ledger = Ledger()
        manifests = [publish(stack, n, "v1", seed=i) for i, n in enumerate([*names, CANARY])]
        for n in [*names, CANARY]:
            ledger.apply(n, "v1", time.monotonic())
        stack.apply(*manifests)
        monitor = Monitor(stack, ledger, time.monotonic(), plan.replicas)
        setup_began = time.monotonic()
        wait_for(lambda: monitor.poll().converged, SETUP_BOUND, "the first convergence", interval=2)
        setup_s = round(time.monotonic() - setup_began, 1)
        log(f"converged in {setup_s} s; load starts for {plan.minutes} min")
        report = _soak(stack, plan, ledger, monitor, names, base_model, log, out)
        report["setup_converged_s"] = setup_s
    return _write(report, out)


def _soak(
    stack, plan: Plan, ledger: Ledger, monitor: Monitor, names: list[str], base_model: str, log, out: Path
) -> dict:
    start = time.monotonic()
    monitor.origin = start
    endpoints = Endpoints(stack, start)
    endpoints.refresh()
    refresher_stop = threading.Event()

    def refresh_loop() -> None:
        while not refresher_stop.wait(0.5):
            try:
                endpoints.refresh()
            except Exception:  # noqa: BLE001 - the last good list stays, as a Service's endpoints would
                pass

    tally = Tally(origin=start)
    sampler = Sampler(stack, start, plan.sample_every_s)
    clients = Clients(endpoints, ledger, tally, names, base_model, plan.clients)
    roller = Roller(stack, plan, ledger, start, names)
    faults = Faults(stack, plan, monitor, roller, start)
    refresher = threading.Thread(target=refresh_loop, name="soak-endpoints", daemon=True)
    for thread in (monitor.thread, sampler.thread, refresher):
        thread.start()
    clients.start()
    roller.thread.start()
    faults.thread.start()
    try:
        deadline, last_partial = start + plan.duration_s, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(min(30.0, max(0.0, deadline - time.monotonic())))
            c = tally.counts
            log(
                f"{time.monotonic() - start:6.0f} s: {c['answers']} answers, {c['retried']} retried, "
                f"{c['failed']} failed, {c['wrong_version']} wrong; faults {len(faults.events)}, "
                f"bumps {len(roller.events)}, errors {roller.errors + faults.errors}"
            )
            if time.monotonic() - last_partial >= PARTIAL_EVERY_S:
                last_partial = time.monotonic()
                try:
                    partial = _report(plan, tally, monitor, sampler, roller, faults, IN_PROGRESS,
                                      time.monotonic() - start, endpoints)  # fmt: skip
                    _write(partial, out, "report.partial.json")
                except Exception as exc:  # noqa: BLE001 - a partial report must never stop the run
                    log(f"partial report failed: {exc!r}")
    finally:
        roller.stop.set()
        faults.stop.set()
        clients.join()
        roller.thread.join(120)
        faults.thread.join(plan.kill_bound_s + 30)
    final = _final(stack, monitor, plan)
    for stopper in (monitor.stop, sampler.stop, refresher_stop):
        stopper.set()
    monitor.thread.join(30)
    sampler.thread.join(30)
    return _report(plan, tally, monitor, sampler, roller, faults, final, time.monotonic() - start, endpoints)


def _final(stack, monitor: Monitor, plan: Plan) -> dict:
    """After the load: converged within the final bound, and the host caches clean."""
    began = time.monotonic()
    at = monitor.wait_converged(began, began + max(plan.final_bound_s, plan.kill_bound_s))
    last = monitor.snapshots[-1]
    caches = {pod: cache_litter(folder) for pod, folder in host_cache_dirs(stack).items()}
    return {"converged": at is not None, "waited_s": round(time.monotonic() - began, 1),
            "lagging": [] if at is not None else last.lagging, "caches": caches}  # fmt: skip


def _report(plan, tally, monitor, sampler, roller, faults, final, elapsed: float, endpoints) -> dict:
    kills = [f for f in faults.events if f["kind"] == "kill_pod"]
    planned = {"kill_pod": len(plan.kill_times()), "restart_operator": len(plan.restart_times())}
    checks = [
        *V.request_checks(tally, kills),
        *V.fault_checks(faults.events, planned),
        *V.canary_checks(roller.canaries, monitor.canary_writes, monitor.snapshots, plan.canary_bound_s),
        *V.trend_checks(sampler.samples, plan.warmup_s, elapsed),
        *V.end_checks(final),
        V.errors_check(roller.errors + faults.errors),
    ]
    cpu = {}
    for s in sampler.samples:
        cpu[s["pod"]] = {"kind": s["kind"], "cpu_s": s["cpu_s"], "last_t": s["t"]}
    return {
        "verdict": "PASS" if all(c["ok"] for c in checks) else "FAIL",
        "plan": {**plan.__dict__, "duration_s": plan.duration_s},
        "elapsed_s": round(elapsed, 1),
        "checks": checks,
        "load": {
            "bucket_s": tally.bucket_s,
            "counts": tally.counts,
            "by_model": tally.by_model,
            "requests_per_bucket": {str(k): v for k, v in sorted(tally.requests.items())},
            "first_failures_per_bucket": {str(k): v for k, v in sorted(tally.first_failures.items())},
            "retried": tally.retried[:50],
            "failed": tally.failed[:50],
        },  # fmt: skip
        "faults": faults.events,
        "pods_joined": endpoints.first_ready,
        "bumps": roller.events,
        "canaries": roller.canaries,
        "monitor_poll_errors": monitor.errors[:30],
        "timeline": timeline(monitor.snapshots),
        "processes_cpu": cpu,
        "final": final,
        "_samples": sampler.samples,
    }


def timeline(snapshots) -> list[dict]:
    """The monitor's polls, one entry each time what it saw changed: converged, ready servers, operator."""
    changes, last = [], None
    for s in snapshots:
        seen = (s.converged, len(s.servers), s.operator is not None)
        if seen != last:
            changes.append({"t": round(s.t, 1), "converged": s.converged, "servers": len(s.servers),
                            "operator": s.operator is not None, "lagging": s.lagging[:2]})  # fmt: skip
            last = seen
    return changes


def _write(report: dict, out: Path, name: str = "report.json") -> dict:
    samples = report.pop("_samples")
    (out / "samples.json").write_text(json.dumps(samples))
    plot(report, samples, out / "soak.png")
    report["plot"] = "soak.png"
    (out / name).write_text(json.dumps(report, indent=1, default=str))
    return report
