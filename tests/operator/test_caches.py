"""The operator's caches: shared fetches, bounds, ages, and the order of status echoes."""

from __future__ import annotations

import asyncio
import time

import kopf

from loraplane.operator.admin_client import PodAddress
from loraplane.operator.builders import BASE_LABEL
from loraplane.operator.caches import (
    Backoff,
    Expiring,
    Fingerprints,
    Memo,
    Quiet,
    SharedResults,
    Snapshots,
    StatusEcho,
)
from loraplane.operator.context import Context
from loraplane.operator.handlers import pod_event


async def test_concurrent_asks_share_one_fetch_and_results_stay_bounded():
    cache: SharedResults[str, int] = SharedResults(max_entries=2)
    calls: list[str] = []

    async def fetch(key: str) -> int:
        calls.append(key)
        await asyncio.sleep(0.01)
        return len(calls)

    results = await asyncio.gather(*(cache.get("a", lambda: fetch("a")) for _ in range(5)))
    assert results == [1] * 5 and calls == ["a"]
    await cache.get("b", lambda: fetch("b"))
    await cache.get("a", lambda: fetch("a"))  # a hit refreshes "a", so "b" is the oldest
    await cache.get("c", lambda: fetch("c"))
    assert len(cache) == 2
    await cache.get("b", lambda: fetch("b"))  # evicted: fetched again
    assert calls == ["a", "b", "c", "b"]


async def test_a_failed_fetch_is_not_remembered():
    cache: SharedResults[str, int] = SharedResults()
    attempts = 0

    async def flaky() -> int:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("S3 down")
        return 7

    try:
        await cache.get("k", flaky)
    except RuntimeError:
        pass
    assert await cache.get("k", flaky) == 7 and attempts == 2


async def test_snapshots_are_shared_until_they_age_or_are_dropped():
    snaps: Snapshots[str, int] = Snapshots()
    taken = 0

    async def take() -> int:
        nonlocal taken
        taken += 1
        return taken

    assert await snaps.get("pod", 60.0, take) == 1
    assert await snaps.get("pod", 60.0, take) == 1
    snaps.drop("pod")
    assert await snaps.get("pod", 60.0, take) == 2
    assert await snaps.get("pod", 0.0, take) == 3  # max_age 0: always fresh


async def test_snapshots_of_pods_that_are_gone_are_dropped_once_stale():
    snaps: Snapshots[str, str] = Snapshots(stale_after=0.05)

    async def listing() -> str:
        return "listing"

    for pod in ("pod-a", "pod-b", "pod-c"):  # replaced one after another: each asked once, then never again
        await snaps.get(pod, 0.01, listing)
        await asyncio.sleep(0.03)
    await asyncio.sleep(0.06)
    await snaps.get("pod-d", 0.01, listing)  # any new listing sweeps out the stale ones
    assert list(snaps._taken) == ["pod-d"]


async def test_a_deleted_pods_listings_are_dropped_at_once():
    snaps: Snapshots[tuple[str, str], str] = Snapshots()

    async def listing() -> str:
        return "listing"

    for key in (("pod-a", "10.0.0.1"), ("pod-a", "10.0.0.9"), ("pod-b", "10.0.0.2")):
        await snaps.get(key, 60.0, listing)
    snaps.drop_if(lambda key: key[0] == "pod-a")
    assert list(snaps._taken) == [("pod-b", "10.0.0.2")]


async def test_the_pod_watch_drops_a_deleted_pods_listing():
    ctx = Context(kube=None)  # the handler touches only the caches and wake-ups
    a, b = PodAddress("demo-a", "10.0.0.1", 8001), PodAddress("demo-b", "10.0.0.2", 8001)

    async def listing() -> dict:
        return {}

    for pod in (a, b):
        await ctx.snapshots.get(pod, 60.0, listing)
    memo = kopf.Memo(ctx=ctx)
    labels = {BASE_LABEL: "demo"}
    body = _pod_body("demo-a", "10.0.0.1")
    pod_event(type="MODIFIED", body=body, namespace="ns", name="demo-a", labels=labels, memo=memo,
              adapters_by_base={})  # fmt: skip
    assert set(ctx.snapshots._taken) == {a, b}, "a pod that changed keeps its listing"
    pod_event(type="DELETED", body=body, namespace="ns", name="demo-a", labels=labels, memo=memo,
              adapters_by_base={})  # fmt: skip
    assert set(ctx.snapshots._taken) == {b}


def _pod_body(name: str, ip: str, ready: str = "True", probed_at: str = "2026-01-01T00:00:00Z") -> dict:
    return {
        "metadata": {"name": name, "labels": {BASE_LABEL: "demo"}},
        "spec": {"containers": [{"name": "server", "ports": [{"name": "admin", "containerPort": 8001}]}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "ContainersReady", "status": ready, "lastTransitionTime": "t0"}],
            "containerStatuses": [{"name": "server", "restartCount": 0, "lastProbeTime": probed_at}],
        },
    }


async def test_pod_events_wake_the_adapters_only_when_what_they_read_changed():
    """A pod event that changes nothing a pass reads (here a container status's timestamp) wakes nobody; a
    readiness change, a new pod and a deletion wake the base and each of its adapters."""
    ctx = Context(kube=None)
    memo = kopf.Memo(ctx=ctx)
    labels, adapters = {BASE_LABEL: "demo"}, {("ns", "demo"): ["a1", "a2"]}

    def event(kind: str, body: dict) -> list[str]:
        ctx._events.clear()
        pod_event(type=kind, body=body, namespace="ns", name="demo-a", labels=labels, memo=memo,
                  adapters_by_base=adapters)  # fmt: skip
        return [key[2] for key, woken in ctx._events.items() if woken.is_set()]

    assert event(None, _pod_body("demo-a", "10.0.0.1", "False")) == ["demo", "a1", "a2"]
    assert event("MODIFIED", _pod_body("demo-a", "10.0.0.1", "False", "later")) == []
    assert event("MODIFIED", _pod_body("demo-a", "10.0.0.1", "True")) == ["demo", "a1", "a2"]
    assert event("MODIFIED", _pod_body("demo-a", "10.0.0.1", "True", "later")) == []
    assert event("DELETED", _pod_body("demo-a", "10.0.0.1", "True")) == ["demo", "a1", "a2"]
    assert ctx.pod_prints._seen == {}, "a deleted pod leaves no fingerprint behind"
    assert event("ADDED", _pod_body("demo-a", "10.0.0.7", "False")) == ["demo", "a1", "a2"]


def test_memo_builds_once_and_fingerprints_report_changes_once():
    memo: Memo[str, object] = Memo()
    first = memo.get("k", object)
    assert memo.get("k", object) is first
    prints: Fingerprints[str] = Fingerprints()
    assert prints.changed("base", (1, 2)) and not prints.changed("base", (1, 2))
    assert prints.changed("base", (2, 2))


def test_status_echo_prefers_the_newer_resource_version():
    echo = StatusEcho()
    watch = {"metadata": {"resourceVersion": "10"}, "status": {"old": True}}
    assert echo.newest("p", watch) is watch
    mine = {"metadata": {"resourceVersion": "12"}, "status": {"old": False}}
    echo.remember("p", mine)
    assert echo.newest("p", watch) is mine
    newer = {"metadata": {"resourceVersion": "13"}}
    assert echo.newest("p", newer) is newer
    assert echo.newest("p", watch) is watch  # the echo was dropped once the watch caught up


def test_backoff_doubles_while_failing_and_resets_on_success():
    b: Backoff[str] = Backoff()
    delays = [b.delay("k", True, steady=30, first=5, longest=40) for _ in range(5)]
    assert delays == [5, 10, 20, 40, 40]
    steady = b.delay("k", False, steady=30, first=5, longest=40)
    assert 27 <= steady <= 33
    assert b.delay("k", True, steady=30, first=5, longest=40) == 5


async def test_expiring_values_share_one_fetch_per_miss_and_expire():
    cache: Expiring[str, int] = Expiring()
    reads: list[int] = []
    release = asyncio.Event()

    async def read() -> int:
        reads.append(len(reads) + 1)
        await release.wait()  # a GET queued behind a busy API server: every ask meanwhile misses
        return reads[-1]

    asks = [asyncio.ensure_future(cache.get("s", 60.0, read)) for _ in range(50)]
    await asyncio.sleep(0.01)
    release.set()
    assert await asyncio.gather(*asks) == [1] * 50 and reads == [1]
    assert await cache.get("s", 60.0, read) == 1 and reads == [1]  # kept
    assert await cache.get("s", 0.0, read) == 2  # expired: read again


async def test_expiring_forgets_and_keeps_no_absence():
    cache: Expiring[str, int | None] = Expiring()
    answers = iter([None, 1, 2, 3, 4])
    gate = asyncio.Event()

    async def read():
        await gate.wait()
        return next(answers)

    gate.set()
    assert await cache.get("s", 60.0, read) is None
    assert await cache.get("s", 60.0, read) == 1, "an absent value is read again next time"
    cache.forget("s")
    assert await cache.get("s", 60.0, read) == 2
    gate.clear()
    running = asyncio.ensure_future(cache.get("s", 0.0, read))  # expired: a read starts and waits
    await asyncio.sleep(0.01)
    cache.forget("s")  # the value changed while that read ran: its answer may predate the change
    gate.set()
    assert await running == 3
    assert await cache.get("s", 60.0, read) == 4, "the read that ran while forgotten is not kept"


async def test_snapshots_amended_by_one_keep_their_age_and_the_rest():
    snaps: Snapshots[str, list] = Snapshots()
    taken = 0

    async def take() -> list:
        nonlocal taken
        taken += 1
        return [("a", taken), ("b", taken)]

    assert await snaps.get("pod", 60.0, take) == [("a", 1), ("b", 1)]
    snaps.amend("pod", lambda old: [x for x in old if x[0] != "a"] + [("a", "new")])
    assert await snaps.get("pod", 60.0, take) == [("b", 1), ("a", "new")] and taken == 1
    assert await snaps.get("pod", 0.0, take) == [("a", 2), ("b", 2)], "an amended listing ages as before"
    snaps.amend("gone", lambda old: old)  # nothing taken: nothing to amend
    slow = asyncio.Event()

    async def slow_take() -> list:
        await slow.wait()
        return [("a", "old")]

    running = asyncio.ensure_future(snaps.get("pod", 0.0, slow_take))  # in flight: may predate the act
    await asyncio.sleep(0)
    snaps.amend("pod", lambda old: [("a", "amended")])
    slow.set()
    await running
    assert await snaps.get("pod", 60.0, take) == [("a", 3), ("b", 3)], "an in-flight listing is dropped"


def test_a_quiet_entry_lasts_its_full_pass_interval_or_until_a_read_changes():
    quiet: Quiet[str] = Quiet(full_every=0.3)
    quiet.remember("a", ("rv1", "base1"), "seen")
    assert quiet.seen("a", ("rv1", "base1")) == "seen"
    assert quiet.seen("a", ("rv2", "base1")) is None, "its object changed: a full pass"
    time.sleep(0.35)
    assert quiet.seen("a", ("rv1", "base1")) is None, "the full pass interval ran out: a full pass"
