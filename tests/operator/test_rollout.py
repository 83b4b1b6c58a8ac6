"""The pure rollout rules: what to load, switch, clean up and undo, from what pods report."""

from __future__ import annotations

from loraplane.operator import rollout as R
from loraplane.operator.admin_client import AdminError, LoadedVersion, PodAddress

V1 = R.Target("chat", "v1", "sha256:" + "1" * 64)
V2 = R.Target("chat", "v2", "sha256:" + "2" * 64)


def version(target: R.Target, state="warm", serving=False) -> LoadedVersion:
    return LoadedVersion(target.name, target.version, target.digest, state, serving)


def pod(name: str, *loaded: LoadedVersion) -> R.PodView:
    return R.PodView(PodAddress(name, "10.0.0.1", 8001), tuple(loaded))


def unreachable(name: str) -> R.PodView:
    return R.PodView(PodAddress(name, "10.0.0.9", 8001), None, AdminError("PodUnreachable", "refused", name))


def test_fresh_pods_load_at_once_busy_pods_within_max_unavailable():
    pods = [pod("a"), pod("b"), pod("c", version(V1, serving=True)), pod("d", version(V1, serving=True)),
            pod("e", version(V1, serving=True))]  # fmt: skip
    batches = R.load_batches(pods, V2, max_unavailable=2)
    assert [[p.name for p in batch] for batch in batches] == [["a", "b", "c", "d"], ["e"]]


def test_a_version_label_is_not_trusted_without_its_digest():
    impostor = LoadedVersion("chat", "v2", "sha256:" + "9" * 64, "warm", True)
    p = pod("a", impostor)
    assert R.needs_load(p, V2) and R.needs_switch(p, V2)
    assert R.needs_cleanup(p, V2) == [impostor]


def test_rollback_switches_back_where_the_old_version_is_warm_and_unloads_the_new():
    switched = pod("a", version(V1), version(V2, serving=True))
    beside = pod("b", version(V1, serving=True), version(V2))
    fresh_only = pod("c", version(V2, serving=True))  # nothing older to go back to: keep serving
    plan = {u.pod.name: u for u in R.rollback_plan([switched, beside, fresh_only, unreachable("d")], V2)}
    assert plan["a"].switch_to == "v1" and plan["a"].unload_target
    assert plan["b"].switch_to is None and plan["b"].unload_target
    assert "c" not in plan and "d" not in plan


def test_pod_rows_say_what_each_pod_does():
    rows = {
        r["name"]: r
        for r in (
            R.pod_row(p, V2, None, "T")
            for p in [
                pod("serving", version(V2, serving=True)),
                pod("warm", version(V1, serving=True), version(V2)),
                pod("loading", version(V2, state="pulling")),
                pod("pending", version(V1, serving=True)),
                unreachable("gone"),
            ]
        )
    }
    assert {n: r["state"] for n, r in rows.items()} == {
        "serving": "Serving", "warm": "Warm", "loading": "Loading", "pending": "Pending", "gone": "Unreachable",
    }  # fmt: skip
    assert rows["warm"]["version"] == "v1" and rows["serving"]["version"] == "v2"
    assert "refused" in rows["gone"]["message"]
    kept = R.pod_row(
        pod("serving", version(V2, serving=True)), V2, {"state": "Serving", "since": "EARLIER"}, "T"
    )
    assert kept["since"] == "EARLIER"


def test_serving_version_is_the_majority():
    pods = [
        pod("a", version(V1, serving=True)),
        pod("b", version(V1, serving=True)),
        pod("c", version(V2, serving=True)),
    ]
    assert R.serving_version(pods, "chat").version == "v1"
    assert R.serving_version([pod("x")], "chat") is None


def test_a_load_answer_updates_the_view_so_a_served_first_version_needs_no_switch():
    fresh = R.with_answer(pod("a"), version(V1, serving=True), V1)  # the pod aliases a first version itself
    assert not R.needs_load(fresh, V1) and not R.needs_switch(fresh, V1)
    beside = R.with_answer(pod("b", version(V1, serving=True)), version(V2), V2)  # loaded beside v1
    assert R.needs_switch(beside, V2) and beside.serving("chat") == version(V1, serving=True)
    moved = R.with_answer(pod("c", version(V1, serving=True)), version(V2, serving=True), V2)
    assert moved.serving("chat") == version(V2, serving=True) and R.needs_cleanup(moved, V2) == [version(V1)]
    warming = R.with_answer(pod("d"), version(V1, state="loaded"), V1)
    assert R.needs_load(warming, V1) and R.needs_switch(warming, V1)
    impostor = LoadedVersion("chat", "v1", "sha256:" + "9" * 64, "warm", True)
    assert R.with_answer(pod("e"), impostor, V1) == pod("e"), "an answer about another digest changes nothing"
    assert R.with_answer(unreachable("f"), version(V1), V1).loaded is None
