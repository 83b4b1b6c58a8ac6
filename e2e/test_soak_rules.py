"""The soak's judging rules on made-up records (fast, no cluster): the version ledger, the attribution of
retried requests to Pod kills, the RSS/threads/fds trend checks, and the plan's fault times."""

from __future__ import annotations

from e2e.soak.load import Ledger
from e2e.soak.schedule import CI_PLAN, Plan
from e2e.soak.verdict import attributed, trend_checks


def test_an_answer_may_come_from_the_previous_version_only_until_the_switch_is_seen():
    ledger = Ledger()
    ledger.apply("a", "v1", 0.0)
    ledger.apply("a", "v2", 10.0)
    assert ledger.allowed("a", 5.0) == {"v1"}
    assert ledger.allowed("a", 12.0) == {"v1", "v2"}, "switching: either"
    ledger.mark_ready("a", "v2", 20.0)
    assert ledger.allowed("a", 19.0) == {"v1", "v2"}
    assert ledger.allowed("a", 21.0) == {"v2"}, "switched everywhere: only the new one"
    ledger.apply("a", "v3", 30.0)
    ledger.retract("a", "v3")
    assert ledger.current("a") == "v2"


def test_a_retry_is_explained_by_its_pods_kill_only():
    kills = [{"t": 100.0, "victim": "p1", "bound_s": 240.0}]
    assert attributed({"pod": "p1", "at": 101.0, "error": "APIConnectionError"}, kills) == "killed"
    assert attributed({"pod": "p1", "at": 300.0, "error": "APIConnectionError"}, kills) is None
    # the Pod that replaced p1 joins only once it serves its adapters: its 404s are failures
    assert attributed({"pod": "p2", "at": 160.0, "error": "NotFoundError: 404"}, kills) is None
    assert attributed({"pod": "p0", "at": 101.0, "error": "NotFoundError: 404"}, kills) is None


def series(pod: str, kind: str, rss, threads=10, fds=30, seconds: int = 3600, step: int = 5) -> list[dict]:
    return [{"t": float(t), "pod": pod, "kind": kind, "rss": rss(t), "threads": threads, "fds": fds, "cpu_s": 0.0}
            for t in range(0, seconds, step)]  # fmt: skip


def verdicts(samples: list[dict]) -> dict[str, bool]:
    return {c["name"]: c["ok"] for c in trend_checks(samples, warmup_s=60.0, end=3600.0)}


def test_flat_processes_pass_and_a_slow_leak_or_a_growing_fd_count_fails():
    flat = series("s", "server", lambda t: 1e9 + (t % 50) * 1e5) + series("o", "operator", lambda t: 2e8)
    assert all(verdicts(flat).values()), verdicts(flat)
    leak = series("s", "server", lambda t: 1e9 + t * 1e9 * 0.02 / 3600) + series(
        "o", "operator", lambda t: 2e8
    )
    assert verdicts(leak)["rss_flat[s]"] is False, "2%/h is a leak"
    fds = series("s", "server", lambda t: 1e9) + [
        {**s, "fds": 30 + int(s["t"] // 60)} for s in series("o", "operator", lambda t: 2e8)
    ]
    assert verdicts(fds)["fds_flat[o]"] is False
    assert verdicts(series("s", "server", lambda t: 1e9))["trends_cover_operator_and_server"] is False


def test_the_plans_put_every_fault_inside_the_run_and_the_last_operator_lives_through_most_of_it():
    hour = Plan()
    assert hour.kill_times() == [300.0 * k for k in range(1, 12)]
    assert hour.restart_times() == [150.0, 450.0]
    assert hour.duration_s - hour.restart_times()[-1] >= 40 * 60
    assert CI_PLAN.kill_times() == [90.0, 180.0] and CI_PLAN.restart_times() == [45.0]
    assert len(CI_PLAN.bump_times()) == 7
