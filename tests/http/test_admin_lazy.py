"""Lazily registered adapters (``PUT /admin/adapters/{name}`` with ``warm: "lazy"``): the PUT verifies the
signed manifest alone and the engine registers the version on its remote tier; the first request pulls the
files from S3 on the engine's loader, in the loads' pipeline.

Real signed artifacts in moto's S3 server, reached through a FaultProxy that can hold an object's GET at a
gate (so a slow pull is deterministic) while the test watches which GETs arrived."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
import time

import httpx
import pytest

from loraplane.artifacts.s3blobs import blob_key
from tests.adapter_factory import push_adapter, resign_edited
from tests.http.adapter_fixtures import BUCKET, adapter_world
from tests.http.conftest import MODEL_NAME, wait_until
from tests.s3_servers import Fault

WEIGHTS = "adapter_model.safetensors"
NAMES = ("chat", "support", "tenant-b", "rogue", "elsewhere")


@pytest.fixture(scope="module")
def world(tmp_path_factory, engine, tiny_chat_model_dir):
    with adapter_world(tmp_path_factory.mktemp("lazy"), engine, tiny_chat_model_dir, s3_proxy=True) as w:
        yield w


@pytest.fixture
def clean(world):
    world.proxy.reset()
    yield world
    world.proxy.reset()
    for name in NAMES:
        world.delete(name)
    for adapter in world.published.values():  # every test's first request pulls from S3 again
        world.source.cache.evict(adapter.digest)


def complete(world, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    return httpx.post(f"{world.public.url}/v1/completions", json=body, timeout=120)


def tokens_of(response: httpx.Response) -> tuple[str, list[float]]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def weights_path(world, name: str) -> str:
    """The URL path's tail of v1's weights: the content-addressed blob the push stored them in."""
    return "/" + blob_key(world.published[f"{name}-v1"].manifest.files[WEIGHTS].sha256)


def weights_gets(world, name: str) -> int:
    """GETs of the version's weights object that reached the proxy (a pull's download)."""
    return world.proxy.count("GET", weights_path(world, name))


def put_lazy(world, name: str) -> dict:
    response = world.put(name, world.published[f"{name}-v1"], warm="lazy")
    assert response.status_code == 200, response.text
    return response.json()


def test_a_lazy_put_pulls_nothing_and_the_first_request_serves_like_an_eager_load(clean, engine):
    world = clean
    entry = put_lazy(world, "chat")
    assert (entry["state"], entry["tier"], entry["serving"]) == ("loaded", "remote", True)
    assert entry["digest"] == world.published["chat-v1"].digest and "manifest" in entry["timings"]
    assert weights_gets(world, "chat") == 0 and engine.tier_of("chat@v1") == "remote"
    lazy = tokens_of(complete(world, "chat"))
    assert weights_gets(world, "chat") == 1  # pulled once, by the first request
    listed = world.versions("chat")["v1"]
    assert listed["tier"] in ("gpu", "host") and {"pull", "download", "verify"} <= set(listed["timings"])
    assert tokens_of(complete(world, "chat")) == lazy  # no second pull, same answer
    assert weights_gets(world, "chat") == 1

    assert world.delete("chat").status_code == 200
    eager = world.put("chat", world.published["chat-v1"])
    assert eager.status_code == 200 and eager.json()["state"] == "warm", eager.text
    text, logprobs = tokens_of(complete(world, "chat"))
    assert text == lazy[0] and logprobs == pytest.approx(lazy[1], abs=1e-5)
    assert tokens_of(complete(world, MODEL_NAME))[1] != pytest.approx(logprobs, abs=1e-5)  # the adapter acts


def test_a_later_eager_put_pulls_and_warms_a_lazy_version(clean, engine):
    world = clean
    put_lazy(world, "support")
    warm = world.put("support", world.published["support-v1"], warm="host")
    assert warm.status_code == 200, warm.text
    assert (warm.json()["state"], warm.json()["tier"]) == ("warm", "gpu")
    assert weights_gets(world, "support") == 1  # pulled by the warm-up, once
    assert len(tokens_of(complete(world, "support"))[1]) == 6


def test_two_lazy_pulls_run_at_once_while_a_resident_adapter_serves(clean, engine):
    world = clean
    assert world.put("tenant-b", world.published["tenant-b-v1"]).status_code == 200
    alone = tokens_of(complete(world, "tenant-b"))
    gates = {
        name: world.proxy.add(Fault("gate", weights_path(world, name))).gate for name in ("chat", "support")
    }
    put_lazy(world, "chat")
    put_lazy(world, "support")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        cold = {name: pool.submit(complete, world, name) for name in gates}
        # both downloads reached S3 before either was answered: two pulls in flight at once
        wait_until(lambda: weights_gets(world, "chat") and weights_gets(world, "support"), "both pulls")
        assert engine.engine.runner.lora.loader.max_in_flight >= 2
        hot = tokens_of(complete(world, "tenant-b"))
        assert hot[0] == alone[0] and hot[1] == pytest.approx(alone[1], abs=1e-5)
        assert not any(f.done() for f in cold.values())
        assert {engine.tier_of(f"{n}@v1") for n in gates} == {"remote"}
        for gate in gates.values():
            gate.set()
        for future in cold.values():
            assert len(tokens_of(future.result(timeout=120))[1]) == 6


@pytest.mark.parametrize(
    "damage, reason", [("truncated", "FileSizeMismatch"), ("tampered", "FileHashMismatch")]
)
def test_a_broken_object_fails_only_its_own_requests_and_leaves_nothing_cached(clean, engine, damage, reason):
    world = clean
    adapter = world.published["support-v1"]
    key = blob_key(adapter.manifest.files[WEIGHTS].sha256)
    good = (adapter.folder / WEIGHTS).read_bytes()
    assert world.put("tenant-b", world.published["tenant-b-v1"]).status_code == 200
    put_lazy(world, "support")
    # S3 changes after the registration: the pull must catch it (size from the listing, bytes by the hash)
    bad = good[: len(good) // 2] if damage == "truncated" else good[:-8] + bytes(8)
    world.s3.put_object(Bucket=BUCKET, Key=key, Body=bad)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            failing = pool.submit(complete, world, "support")
            assert len(tokens_of(complete(world, "tenant-b"))[1]) == 6
            answer = failing.result(timeout=120)
        assert answer.status_code >= 400 and f"adapter 'support@v1': {reason}" in answer.text, answer.text
        listed = world.versions("support")["v1"]
        assert listed["state"] == "failed" and listed["error"]["reason"] == reason, listed
        assert WEIGHTS in listed["error"]["message"]  # the admin API has the details
        assert_nothing_cached(world, adapter)
        assert len(tokens_of(complete(world, "tenant-b"))[1]) == 6  # the engine goes on
    finally:
        world.s3.put_object(Bucket=BUCKET, Key=key, Body=good)
    again = put_lazy(world, "support")  # the next PUT registers it afresh, and it serves
    assert again["state"] == "loaded" and again["error"] is None
    assert len(tokens_of(complete(world, "support"))[1]) == 6


def assert_nothing_cached(world, adapter) -> None:
    """No folder of the refused version, no blob of its weights, no orphan blob, nothing left in tmp/."""
    root = world.source.cache.root
    assert not (root / "adapters" / adapter.digest.removeprefix("sha256:")).exists()
    weights_sha = adapter.manifest.files[WEIGHTS].sha256
    blobs = {e.name: e.stat().st_nlink for e in os.scandir(root / "blobs")}
    assert weights_sha not in blobs and all(n > 1 for n in blobs.values()), blobs
    assert not list((root / "tmp").iterdir())


def test_the_engine_thread_sleeps_while_only_s3_cold_requests_wait(clean, engine):
    """The engine thread's own CPU time (time.thread_time, read on that thread after each step) while the
    only requests wait for a pull held at the gate: a spinning loop burns ~100 %."""
    world = clean
    recording, samples = threading.Event(), []

    def sample(_stats) -> None:
        if recording.is_set():
            samples.append((time.perf_counter(), time.thread_time()))

    engine.add_step_listener(sample)
    gate = world.proxy.add(Fault("gate", weights_path(world, "chat"))).gate
    put_lazy(world, "chat")
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            cold = [pool.submit(complete, world, "chat") for _ in range(3)]
            wait_until(lambda: weights_gets(world, "chat"), "the pull to reach S3")
            recording.set()
            time.sleep(1.0)
            recording.clear()
            window = list(samples)
            gate.set()
            assert all(len(tokens_of(f.result(timeout=120))[1]) == 6 for f in cold)
    finally:
        recording.clear()
        gate.set()
    assert len(window) >= 2, "the loop must still look now and then (time-based limits)"
    wall = window[-1][0] - window[0][0]
    cpu = window[-1][1] - window[0][1]
    assert wall > 0.5 and cpu / wall < 0.10, f"engine thread busy {cpu / wall:.0%} of {wall:.2f} s"


@pytest.mark.parametrize(
    "key, status, reason", [("rogue-v1", 422, "UnknownKey"), ("elsewhere-v1", 409, "BaseMismatch")]
)
def test_a_lazy_put_still_refuses_what_the_manifest_refuses(clean, engine, key, status, reason):
    adapter = clean.published[key]
    response = clean.put(adapter.manifest.name, adapter, warm="lazy")
    assert response.status_code == status and response.json()["reason"] == reason, response.text
    assert not [a for a in engine.adapters() if a.name == adapter.manifest.name]
    assert weights_gets(clean, adapter.manifest.name) == 0


def fail_the_pull(world, name: str) -> Fault:
    """The next pulls of ``name`` v1's weights are refused by S3 (403: not retried)."""
    return world.proxy.add(
        Fault("status", weights_path(world, name), times=100, status=403, code="AccessDenied")
    )


def test_a_request_whose_pull_failed_learns_the_adapter_and_reason_not_the_source(clean, engine):
    world = clean
    fail_the_pull(world, "chat")
    put_lazy(world, "chat")
    answer = complete(world, "chat")
    assert answer.status_code >= 400 and "adapter 'chat@v1': AccessDenied" in answer.text, answer.text
    endpoint = world.proxy.url.split("//")[1]
    assert "s3://" not in answer.text and endpoint not in answer.text and BUCKET not in answer.text, (
        answer.text
    )
    listed = world.versions("chat")["v1"]  # the admin API shows where it failed
    assert listed["error"]["reason"] == "PullFailed" and "s3://" in listed["error"]["message"], listed


def test_a_warm_put_of_a_lazy_version_whose_pull_fails_answers_the_pulls_reason(clean, engine):
    world = clean
    fail_the_pull(world, "support")
    put_lazy(world, "support")
    warm = world.put("support", world.published["support-v1"], warm="host")
    body = warm.json()
    assert (warm.status_code, body["reason"]) == (500, "PullFailed"), warm.text  # not WarmFailed
    assert body["message"].startswith("adapter 'support@v1': AccessDenied: pull: s3://"), body  # named once


@pytest.mark.parametrize("how", ["retry-failed", "delete-then-put"])
def test_a_lazy_version_put_again_while_a_request_holds_it_pulls_afresh(clean, engine, how):
    """The next PUT after a failed pull (or a DELETE) while a request of the version is still in flight: the
    engine keeps the old record for that request, and the new registration's pull must serve."""
    world, lora = clean, engine.engine.runner.lora
    if how == "retry-failed":
        fault = fail_the_pull(world, "support")
        put_lazy(world, "support")
        assert complete(world, "support").status_code >= 400
        fault.times = 0
    else:
        put_lazy(world, "support")
    lora.hold("support@v1")  # a request submitted and not yet ended
    try:
        if how == "delete-then-put":
            assert world.delete("support").status_code == 200
        again = put_lazy(world, "support")
        assert (again["state"], again["error"]) == ("loaded", None), again
    finally:
        lora.note_request("support@v1", -1)
    assert len(tokens_of(complete(world, "support"))[1]) == 6
    assert world.versions("support")["v1"]["error"] is None


def test_a_lazy_pull_is_pinned_to_the_manifest_verified_at_registration(clean, engine, tmp_path):
    """Registered without a digest, then the URI is pushed again with other weights: the pull refuses the
    new manifest before it downloads any of its files."""
    world = clean
    adapter = world.published["support-v1"]
    response = world.put("support", adapter, warm="lazy", manifest_digest=None)
    assert response.status_code == 200 and response.json()["digest"] == adapter.digest, response.text

    def other_weights(folder) -> None:
        weights = folder / WEIGHTS
        weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))

    resign_edited(adapter.folder, tmp_path / "repushed", world.keys, other_weights)
    new_blob = "/" + blob_key(hashlib.sha256((tmp_path / "repushed" / WEIGHTS).read_bytes()).hexdigest())
    assert push_adapter(tmp_path / "repushed", world.s3, BUCKET, force=True) == adapter.uri
    try:
        answer = complete(world, "support")
        assert answer.status_code >= 400 and "DigestMismatch" in answer.text, answer.text
        assert world.proxy.count("GET", new_blob) == 0  # refused at the manifest
    finally:
        push_adapter(adapter.folder, world.s3, BUCKET, force=True)


def test_a_disk_put_pulls_now_and_the_first_request_loads_from_the_node(clean, engine):
    """``warm: "disk"``: the PUT pulls and verifies into the host cache and registers the folder on the disk
    tier (nothing in host memory or on the GPU); the first request loads it with no S3 call, same tokens
    as an eager load; a later eager PUT warms it."""
    world = clean
    response = world.put("chat", world.published["chat-v1"], warm="disk")
    assert response.status_code == 200, response.text
    entry = response.json()
    assert (entry["state"], entry["tier"], entry["serving"]) == ("loaded", "disk", True)
    assert {"download", "verify"} <= set(entry["timings"])
    assert weights_gets(world, "chat") == 1 and engine.tier_of("chat@v1") == "disk"
    on_disk = tokens_of(complete(world, "chat"))
    assert weights_gets(world, "chat") == 1  # loaded from this node's disk, not S3
    assert engine.tier_of("chat@v1") in ("gpu", "host")
    warm = world.put("chat", world.published["chat-v1"], warm="gpu")
    assert warm.status_code == 200 and warm.json()["state"] == "warm", warm.text
    assert tokens_of(complete(world, "chat")) == on_disk

    assert world.delete("chat").status_code == 200
    eager = world.put("chat", world.published["chat-v1"])
    assert eager.status_code == 200, eager.text
    text, logprobs = tokens_of(complete(world, "chat"))
    assert text == on_disk[0] and logprobs == pytest.approx(on_disk[1], abs=1e-5)
