"""The admin API for real: signed adapters pulled from moto S3 through the host cache into the engine,
driven by raw httpx and by the operator's own AdminClient."""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import pytest

from loraplane.operator.admin_client import AdminClient, AdminError, LoadRequest, PodAddress
from tests.adapter_factory import edit_config
from tests.http.adapter_fixtures import ADMIN_HEADERS, ADMIN_TOKEN, adapter_world
from tests.http.conftest import wait_until


@pytest.fixture(scope="module")
def world(tmp_path_factory, engine, tiny_chat_model_dir):
    with adapter_world(tmp_path_factory.mktemp("admin"), engine, tiny_chat_model_dir) as w:
        yield w


@pytest.fixture
def clean(world):
    yield world
    for name in ("chat", "support", "rogue", "elsewhere", "tenant-b"):
        world.delete(name)


@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {ADMIN_TOKEN}", ADMIN_TOKEN])
def test_nothing_answers_without_the_token(world, header):
    headers = {"Authorization": header} if header else {}
    for method, path in [("GET", "/health/ready"), ("GET", "/health/live"), ("GET", "/admin/adapters"),
                         ("PUT", "/admin/adapters/a"), ("POST", "/admin/adapters/a/alias"),
                         ("DELETE", "/admin/adapters/a"), ("GET", "/metrics"), ("GET", "/nope")]:  # fmt: skip
        response = httpx.request(method, world.admin.url + path, headers=headers, json={})
        assert response.status_code == 401, (method, path)
        assert response.json()["reason"] == "Unauthorized" and ADMIN_TOKEN not in response.text


def test_the_bearer_scheme_is_case_insensitive_on_both_ports(world):
    assert httpx.get(
        f"{world.admin.url}/admin/adapters", headers={"Authorization": f"bearer {ADMIN_TOKEN}"}
    ).is_success


def test_nothing_admin_is_reachable_from_the_public_port(world):
    for method, path in [("GET", "/admin/adapters"), ("PUT", "/admin/adapters/chat"), ("GET", "/metrics"),
                         ("DELETE", "/admin/adapters/chat")]:  # fmt: skip
        response = httpx.request(method, world.public.url + path, headers=ADMIN_HEADERS, json={})
        assert response.status_code in (404, 405), (method, path)


def test_load_serve_swap_and_unload(clean):
    world = clean
    v1, v2 = world.published["chat-v1"], world.published["chat-v2"]
    first = world.put("chat", v1)
    assert first.status_code == 200, first.text
    entry = first.json()
    assert (entry["state"], entry["serving"], entry["digest"]) == ("warm", True, v1.digest)
    assert set(entry["timings"]) >= {"download", "verify", "load", "warm"}
    assert world.put("chat", v1).json()["state"] == "warm"  # idempotent
    conflict = world.put("chat", v1, manifest_digest=v2.digest)  # the same name@version, another artifact
    assert conflict.status_code == 409 and conflict.json()["reason"] == "AdapterConflict"
    second = world.put("chat", v2, pin=True)
    assert second.status_code == 200 and not second.json()["serving"]  # loaded beside the serving one
    listed = world.versions("chat")
    assert {v: (e["serving"], e["state"]) for v, e in listed.items()} == {
        "v1": (True, "warm"),
        "v2": (False, "warm"),
    }
    assert listed["v2"]["pinned"] and listed["v2"]["tier"] == "gpu" and listed["v2"]["bytes"] > 0
    alias = httpx.post(
        f"{world.admin.url}/admin/adapters/chat/alias", json={"version": "v2"}, headers=ADMIN_HEADERS
    )
    assert alias.status_code == 200 and alias.json()["serving"]
    assert world.versions("chat")["v1"]["serving"] is False
    unpin = httpx.post(f"{world.admin.url}/admin/adapters/chat/pin", json={"version": "v2", "pinned": False},
                       headers=ADMIN_HEADERS)  # fmt: skip
    assert unpin.status_code == 200 and not unpin.json()["pinned"]
    assert world.delete("chat", "v1").json() == {"unloaded": ["chat@v1"]}
    assert world.delete("chat", "v1").status_code == 404
    assert world.delete("chat", "v2").status_code == 200  # the serving version: the route goes with it
    assert world.versions("chat") == {}
    models = httpx.get(f"{world.public.url}/v1/models").json()["data"]
    assert "chat" not in {m["id"] for m in models}


@pytest.mark.parametrize(
    "key, change, status, reason",
    [
        ("rogue-v1", {}, 422, "UnknownKey"),
        ("elsewhere-v1", {}, 409, "BaseMismatch"),
        ("support-v1", {"manifest_digest": "sha256:" + "0" * 64}, 422, "DigestMismatch"),
        ("support-v1", {"uri": "s3://adapters/nothing-here/v1/"}, 500, "PullFailed"),
        ("support-v1", {"version": "v9"}, 422, "BadManifest"),  # the manifest says v1
    ],
)
def test_failures_carry_the_contracts_reason_and_leave_nothing(clean, engine, key, change, status, reason):
    adapter = clean.published[key]
    name = adapter.manifest.name
    response = clean.put(name, adapter, **change)
    assert response.status_code == status, response.text
    assert response.json()["reason"] == reason and response.json()["message"]
    assert not [a for a in engine.adapters() if a.name == name]  # nothing half-loaded
    listed = clean.versions(name)
    (entry,) = listed.values()
    assert entry["state"] == "failed" and entry["error"]["reason"] == reason


@pytest.mark.parametrize(
    "version, changes, field",
    [("rnull", {"r": None}, "adapter_config.json.r"), ("rtext", {"r": "4"}, "adapter_config.json.r"),
     ("anull", {"lora_alpha": None}, "adapter_config.json.lora_alpha"),
     ("pnull", {"rank_pattern": {"q_proj": None}}, "adapter_config.json.rank_pattern.q_proj"),
     ("norank", {"r": ...}, "adapter_config.json.r"),  # PEFT's default r (8), not the weights' rank 4
     ("qalora", {"use_qalora": True}, "adapter_config.json.use_qalora"),
     ("future", {"future_option": None}, "adapter_config.json.future_option")],
)  # fmt: skip
def test_a_signed_config_the_engine_cannot_compute_is_refused_naming_the_field(clean, engine, version, changes,
                                                                               field):  # fmt: skip
    adapter = clean.publish_edited(clean.published["chat-v1"], version, edit_config(**changes))
    response = clean.put("chat", adapter)
    assert response.status_code >= 400 and field in response.json()["message"], response.text
    assert not [a for a in engine.adapters() if a.name == "chat"]


def test_bad_bodies_and_names_are_refused_naming_the_field(world):
    url = f"{world.admin.url}/admin/adapters"
    good = {"uri": "s3://a/b/", "version": "v1"}
    for name, body, field in [("chat", {**good, "uri": "http://x/"}, "uri"), ("chat", {**good, "warm": "tpu"}, "warm"),
                              ("chat", {**good, "manifest_digest": "md5:1"}, "manifest_digest"),
                              ("Bad_Name", good, "name"), ("x" * 64, good, "name"),
                              ("chat", {**good, "extra": 1}, "extra")]:  # fmt: skip
        response = httpx.put(f"{url}/{name}", json=body, headers=ADMIN_HEADERS)
        assert response.status_code == 422 and response.json()["message"].startswith(field), response.text


def test_concurrent_puts_share_one_download(clean):
    world, adapter = clean, clean.published["support-v1"]
    pulls = lambda: sum(world.source.cache.stats()[k] for k in ("hits", "misses"))  # noqa: E731
    before = pulls()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: world.put("support", adapter), range(8)))
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    assert pulls() == before + 1  # one pull served all eight
    assert len(world.versions("support")) == 1


async def test_202_while_in_progress_then_200(tmp_path, engine, tiny_chat_model_dir):
    with adapter_world(tmp_path, engine, tiny_chat_model_dir, wait_s=0.0) as world:
        adapter = world.published["support-v1"]
        first = await asyncio.to_thread(world.put, "support", adapter)
        assert first.status_code == 202 and first.json()["state"] in ("pulling", "cached", "loaded")
        wait_until(lambda: world.put("support", adapter).status_code == 200, "the load to finish")
        assert world.versions("support")["v1"]["state"] == "warm"


async def test_the_operators_admin_client_against_the_real_server(clean):
    world = clean
    pod = PodAddress("pod-0", "127.0.0.1", world.admin.port)
    v1, v2 = world.published["chat-v1"], world.published["chat-v2"]
    client = AdminClient(connect_timeout=2, read_timeout=60)
    try:
        ready = await client.ready(pod, ADMIN_TOKEN)
        assert ready["status"] == "ready" and len(ready["base_hash"]) == 64
        await client.unload(pod, ADMIN_TOKEN, "chat")  # nothing loaded: 404, which is success
        loaded = await client.load(
            pod, ADMIN_TOKEN, "chat", LoadRequest(v1.uri, "v1", v1.digest, False, "gpu")
        )
        assert (loaded.state, loaded.serving, loaded.digest) == ("warm", True, v1.digest)
        beside = await client.load(
            pod, ADMIN_TOKEN, "chat", LoadRequest(v2.uri, "v2", v2.digest, True, "host")
        )
        assert (beside.state, beside.serving) == ("warm", False)
        await client.switch(pod, ADMIN_TOKEN, "chat", "v2")
        listed = {(v.version, v.serving, v.state) for v in await client.list(pod, ADMIN_TOKEN, "chat")}
        assert listed == {("v1", False, "warm"), ("v2", True, "warm")}
        with pytest.raises(AdminError) as not_loaded:
            await client.switch(pod, ADMIN_TOKEN, "chat", "v3")
        assert "404" in not_loaded.value.message
        await client.unload(pod, ADMIN_TOKEN, "chat", "v1")
        await client.unload(pod, ADMIN_TOKEN, "chat", "v1")  # absent is success
        rogue = world.published["rogue-v1"]
        with pytest.raises(AdminError) as refused:
            await client.load(
                pod, ADMIN_TOKEN, "rogue", LoadRequest(rogue.uri, "v1", rogue.digest, False, "gpu")
            )
        assert refused.value.reason == "UnknownKey"
        await client.unload(pod, ADMIN_TOKEN, "chat")
        assert await client.list(pod, ADMIN_TOKEN, "chat") == []
    finally:
        await client.aclose()
