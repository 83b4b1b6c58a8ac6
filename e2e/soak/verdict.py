"""The soak's assertions, over what the runner recorded. Each check is ``{"name", "ok", "criterion", ...}``; the
report holds them all, and the soak passes when every one is ok.

Trends (RSS, threads, fds) are judged on the processes that lived through the run: the server Pod never killed
(the Pod killer takes the youngest) and the operator started last, over the last 2/3 of their life after the
warm-up. RSS: the least-squares slope; runs whose window is at least 30 minutes need a slope under 1% of the
mean level per hour; shorter windows cannot resolve 1%/h against the allocator's noise, so they need the
fitted rise across the window under ``SHORT_RISE`` of the level. Threads and fds: bursts of connections come
and go, a leak never goes, so the least count in the window's last third may be at most a small slack above the
least in its first third.
"""

from __future__ import annotations

import statistics
from collections import Counter

LONG_WINDOW_S = 30 * 60
LONG_SLOPE = 0.01  # of the level, per hour
SHORT_RISE = 0.02  # of the level, across the window
THREAD_SLACK, FD_SLACK = 2, 10
KILL_WINDOW = (-2.0, 60.0)  # seconds around a Pod kill in which its requests' failures are the kill's


def check(name: str, ok: bool, criterion: str, **detail) -> dict:
    return {"name": name, "ok": bool(ok), "criterion": criterion, **detail}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def long_lived(samples: list[dict], warmup_s: float, end: float) -> dict[str, list[dict]]:
    """Series of the processes alive at the end that ran at least half the post-warm-up time."""
    series: dict[str, list[dict]] = {}
    for s in samples:
        series.setdefault(s["pod"], []).append(s)
    keep = {}
    for pod, points in series.items():
        alive_at_end = points[-1]["t"] >= end - 30
        span = points[-1]["t"] - max(points[0]["t"], warmup_s)
        if alive_at_end and span >= (end - warmup_s) / 2:
            keep[pod] = points
    return keep


def window(points: list[dict], warmup_s: float) -> list[dict]:
    """The last 2/3 of the series after the warm-up."""
    after = [p for p in points if p["t"] >= warmup_s] or points
    begin = after[0]["t"] + (after[-1]["t"] - after[0]["t"]) / 3
    return [p for p in after if p["t"] >= begin]


def trend_checks(samples: list[dict], warmup_s: float, end: float) -> list[dict]:
    checks = []
    for pod, points in sorted(long_lived(samples, warmup_s, end).items()):
        w = window(points, warmup_s)
        if len(w) < 8:
            checks.append(
                check(f"rss_flat[{pod}]", False, "at least 8 samples in the window", samples=len(w))
            )
            continue
        span = w[-1]["t"] - w[0]["t"]
        level = statistics.fmean(p["rss"] for p in w)
        per_s = slope([(p["t"], p["rss"]) for p in w])
        per_hour, rise = per_s * 3600 / level, per_s * span / level
        if span >= LONG_WINDOW_S:
            ok, criterion = per_hour < LONG_SLOPE, f"slope < {LONG_SLOPE:.0%} of level per hour"
        else:
            ok, criterion = (
                rise < SHORT_RISE,
                f"window < 30 min: fitted rise across it < {SHORT_RISE:.0%} of level",
            )
        checks.append(check(f"rss_flat[{pod}]", ok, criterion, kind=w[0]["kind"], window_s=round(span),
                            level_mb=round(level / 2**20, 1), slope_pct_per_h=round(100 * per_hour, 2),
                            rise_pct=round(100 * rise, 2)))  # fmt: skip
        third = max(1, len(w) // 3)
        for key, slack in (("threads", THREAD_SLACK), ("fds", FD_SLACK)):
            # Bursts of connections come and go; what leaks never goes: the floor rises.
            first, last = min(p[key] for p in w[:third]), min(p[key] for p in w[-third:])
            checks.append(check(f"{key}_flat[{pod}]", last <= first + slack,
                                f"the least of the window's last third <= the least of its first third + {slack}",
                                first=first, last=last, max=max(p[key] for p in w)))  # fmt: skip
    if not checks:
        checks.append(check("rss_flat", False, "a long-lived server and operator were sampled"))
    kinds = {c.get("kind") for c in checks if c["name"].startswith("rss_flat[")}
    checks.append(check("trends_cover_operator_and_server", kinds >= {"server", "operator"},
                        "a long-lived server Pod and the last operator both judged", kinds=sorted(k for k in kinds if k)))  # fmt: skip
    return checks


def attributed(first: dict, kills: list[dict]) -> str | None:
    """Why a first attempt failed, when a Pod kill explains it: ``killed`` (its Pod was killed around then).
    A Pod that replaced a killed one explains nothing: it takes traffic only once the operator has loaded its
    adapters (the server Pods' readiness gate), so a 404 from it is a failure like any other."""
    for kill in kills:
        lo, hi = kill["t"] + KILL_WINDOW[0], kill["t"] + KILL_WINDOW[1]
        if first.get("pod") == kill["victim"] and lo <= first.get("at", -1e9) <= hi:
            return "killed"
    return None


def request_checks(tally, kills: list[dict]) -> list[dict]:
    counts = tally.counts
    causes = Counter(attributed(r["first"], kills) for r in tally.retried)
    unexplained = [r for r in tally.retried if attributed(r["first"], kills) is None]
    return [
        check("no_failed_request", counts["failed"] == 0, "zero requests failed after the one retry",
              failed=counts["failed"], examples=tally.failed[:5]),
        check("retries_only_after_pod_kills", not unexplained,
              f"every retried request's first attempt failed on a Pod killed {KILL_WINDOW} s around it",
              retried=counts["retried"], causes={str(k): v for k, v in causes.items()},
              unexplained=len(unexplained), examples=unexplained[:5]),
        check("no_wrong_version", counts["wrong_version"] == 0,
              "each answer's version is the one current at the request's start, or the one before during the switch",
              wrong=counts["wrong_version"], examples=tally.wrong_version[:5]),
        check("load_ran", counts["answers"] > 0 and len(tally.by_model) >= 2, "answers from adapters and the base",
              answers=counts["answers"], models=len(tally.by_model)),
    ]  # fmt: skip


def fault_checks(faults: list[dict], planned: dict[str, int]) -> list[dict]:
    """Every fault carried out converged within its bound; each planned kind happened at least once (a fault
    waits for the previous one to converge, so the last planned ones may fall past the end of a slow run)."""
    late = [f for f in faults if f.get("converged_s") is None or f["converged_s"] > f["bound_s"]]
    done = {kind: sum(1 for f in faults if f["kind"] == kind) for kind in planned}
    missing = [kind for kind, n in planned.items() if n and not done[kind]]
    return [check("faults_converged", not late and not missing,
                  "after each fault, converged (operator up, Pods Ready, every adapter Ready on every Pod, statuses "
                  "current) within the fault's bound_s; each planned kind of fault happened",
                  done=done, planned=planned, late=late)]  # fmt: skip


def canary_checks(canaries: list[dict], writes: dict[int, float], snapshots, bound: float) -> list[dict]:
    """Each canary change gets its status write within ``bound`` of the change, or of the operator's return."""
    late = []
    for c in canaries:
        written = min((t for g, t in writes.items() if g >= c["generation"]), default=None)
        back = next((s.t for s in snapshots if s.t >= c["t"] and s.operator), c["t"])
        c["write_s"] = None if written is None else round(written - c["t"], 1)
        if written is None or written - max(c["t"], back) > bound:
            late.append(c)
    return [check("canary_status_writes", not late and bool(canaries),
                  f"each canary spec change's observedGeneration written within {bound:.0f} s (of the operator "
                  "being up)", changes=len(canaries), late=late,
                  max_write_s=max((c["write_s"] or 0 for c in canaries), default=None))]  # fmt: skip


def end_checks(final: dict) -> list[dict]:
    return [
        check("all_ready_at_end", not final["lagging"] and final["converged"],
              "every LoRAAdapter Ready, observedGeneration current, status.pods = the ready Pods, each Pod's "
              "/admin/adapters serving the current version", lagging=final["lagging"], waited_s=final["waited_s"]),
        check("host_caches_clean", not any(v["orphan_blobs"] or v["part_files"] for v in final["caches"].values()),
              "no orphan blob (linked by no adapter) and no .part file in any live server Pod's host cache",
              caches=final["caches"]),
    ]  # fmt: skip


def errors_check(errors: list[str]) -> dict:
    return check("runner_actions_succeeded", not errors, "every bump, canary change and fault was carried out",
                 errors=errors[:10])  # fmt: skip
