"""Canary traffic splits on a real server: the admin API sets a split, requests naming the alias go to the canary
by the stable hash of their route key (header, then `user`, then the API key), the answer names the version, and
each version's window of counts is what the clients saw."""

from __future__ import annotations

import collections

import httpx
import pytest

from loraplane.http.canary import BUCKETS, ROUTE_KEY_HEADER, TTFT_BOUNDS, Splits, VersionStats, bucket
from loraplane.http.openai_api import VERSION_HEADER
from tests.http.adapter_fixtures import ADMIN_HEADERS, adapter_world


@pytest.fixture(scope="module")
def world(tmp_path_factory, engine, tiny_chat_model_dir):
    with adapter_world(tmp_path_factory.mktemp("canary"), engine, tiny_chat_model_dir) as w:
        for label in ("chat-v1", "chat-v2"):
            assert w.put("chat", w.published[label]).status_code == 200
        yield w


def set_split(world, version: str, weight, name: str = "chat") -> httpx.Response:
    return httpx.put(f"{world.admin.url}/admin/adapters/{name}/split", json={"version": version, "weight": weight},
                     headers=ADMIN_HEADERS)  # fmt: skip


def ask(client: httpx.Client, world, headers=None, **body) -> str:
    answer = client.post(f"{world.public.url}/v1/completions", headers=headers or {},
                         json={"model": "chat", "prompt": "hi", "max_tokens": 1, **body})  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.headers[VERSION_HEADER]


def test_buckets_are_uniform_and_a_larger_weight_only_adds_keys():
    keys = [f"conversation-{i}" for i in range(20_000)]
    places = [bucket("chat", k) for k in keys]
    for weight in (5, 20, 50, 80):
        share = sum(p < weight * BUCKETS // 100 for p in places) / len(places)
        assert abs(share - weight / 100) < 0.01, (weight, share)
    assert places == [bucket("chat", k) for k in keys]  # stable
    assert bucket("chat", "x") != bucket("other", "x") or bucket("chat", "y") != bucket("other", "y")


def test_ttft_histogram_buckets_each_sample_once():
    stats = VersionStats()
    samples = (0.0005, 0.05, 0.0501, 3.0, 1e6)
    for seconds in samples:
        stats.observe_ttft(seconds)
    view = stats.view()["ttft"]
    assert sum(view.values()) == len(samples) and view["+Inf"] == 1
    for seconds in samples[:-1]:  # each in the bucket of the smallest bound at or above it
        bound = min(b for b in TTFT_BOUNDS if b >= seconds)
        assert view[str(bound)] >= 1 and bound / 1.1 < max(seconds, 0.001) <= bound
    assert TTFT_BOUNDS[0] == 0.001 and TTFT_BOUNDS[-1] > 100


def test_split_routes_by_route_key_and_counts_each_version(world):
    assert set_split(world, "v2", 30).status_code == 200
    seen: dict[str, str] = {}
    with httpx.Client(timeout=60) as client:
        for i in range(300):
            seen[f"k{i}"] = ask(client, world, {ROUTE_KEY_HEADER: f"k{i}"})
        again = {k: ask(client, world, {ROUTE_KEY_HEADER: k}) for k in list(seen)[:40]}
    counts = collections.Counter(seen.values())
    assert abs(counts["v2"] / 300 - 0.30) <= 0.05, counts
    assert again == {k: seen[k] for k in again}  # one key, one version
    expected = {k: "v2" if bucket("chat", f"h:{k}") < 3000 else "v1" for k in seen}
    assert seen == expected  # the documented hash, not luck
    window = world.admin_get("/admin/adapters/chat/split").json()
    assert (window["stable"], window["canary"], window["weight"]) == ("v1", "v2", 30)
    tally = collections.Counter(list(seen.values()) + list(again.values()))
    for version in ("v1", "v2"):
        stats = window["versions"][version]
        assert stats["requests"] == tally[version] and stats["errors"] == 0
        assert sum(stats["ttft"].values()) == tally[version]


def test_same_split_keeps_its_window_a_new_weight_starts_one(world):
    set_split(world, "v2", 40)
    with httpx.Client(timeout=60) as client:
        for i in range(5):
            ask(client, world, {ROUTE_KEY_HEADER: f"w{i}"})
    before = world.admin_get("/admin/adapters/chat/split").json()
    assert set_split(world, "v2", 40).json()["since"] == before["since"]
    total = sum(v["requests"] for v in set_split(world, "v2", 40).json()["versions"].values())
    assert total == 5
    fresh = set_split(world, "v2", 60).json()
    assert fresh["since"] > before["since"] and all(v["requests"] == 0 for v in fresh["versions"].values())


def test_user_field_routes_when_no_header_and_the_header_wins(world):
    set_split(world, "v2", 50)
    users = [f"user-{i}" for i in range(60)]
    with httpx.Client(timeout=60) as client:
        by_user = {u: ask(client, world, user=u) for u in users}
        header_first = {u: ask(client, world, {ROUTE_KEY_HEADER: u}, user="someone-else") for u in users}
    assert by_user == {u: "v2" if bucket("chat", f"u:{u}") < 5000 else "v1" for u in users}
    assert header_first == {u: "v2" if bucket("chat", f"h:{u}") < 5000 else "v1" for u in users}


def test_weight_zero_and_name_at_version_bypass_the_split(world):
    set_split(world, "v2", 0)
    with httpx.Client(timeout=60) as client:
        assert {ask(client, world, {ROUTE_KEY_HEADER: f"z{i}"}) for i in range(20)} == {"v1"}
        set_split(world, "v2", 100)
        assert {ask(client, world, {ROUTE_KEY_HEADER: f"z{i}"}) for i in range(20)} == {"v2"}
        answer = client.post(f"{world.public.url}/v1/completions",
                             json={"model": "chat@v1", "prompt": "hi", "max_tokens": 1})  # fmt: skip
        assert answer.headers[VERSION_HEADER] == "v1"


def test_split_errors_name_the_field_and_unloading_the_canary_drops_it(world):
    bad = set_split(world, "v2", 101)
    assert bad.status_code == 422 and "weight" in bad.json()["message"]
    assert set_split(world, "v9", 10).status_code == 404
    assert set_split(world, "v1", 10, name="support").status_code == 404
    assert (
        httpx.delete(f"{world.admin.url}/admin/adapters/nobody/split", headers=ADMIN_HEADERS).status_code
        == 404
    )
    set_split(world, "v2", 100)
    assert world.delete("chat", "v2").status_code == 200
    assert world.admin_get("/admin/adapters/chat/split").status_code == 404
    with httpx.Client(timeout=60) as client:
        assert {ask(client, world, {ROUTE_KEY_HEADER: f"u{i}"}) for i in range(10)} == {"v1"}
    assert world.put("chat", world.published["chat-v2"]).status_code == 200
    assert world.admin_get("/admin/splits").json() == {"splits": []}


def test_splits_drop_only_the_named_canary():
    splits = Splits()
    splits.set("a", "v2", 10)
    assert not splits.drop("a", "v1") and splits.get("a") is not None
    assert splits.drop("a", "v2") and splits.get("a") is None
