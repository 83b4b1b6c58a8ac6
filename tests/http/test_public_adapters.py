"""`model` names an adapter: answers equal the engine's own output for that adapter, tenants see only their
adapters (the 404 hides the others), per-key limits answer 429 with Retry-After, and a version swap in the
middle of a stream loop fails no request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest

from loraplane.engine.core.sequence import SamplingParams
from loraplane.http.auth import ApiKeys
from loraplane.http.openai_api import VERSION_HEADER
from tests.http.adapter_fixtures import ADMIN_HEADERS, adapter_world
from tests.http.conftest import MODEL_NAME, wait_until

KEYS_YAML = """keys:
  - key: key-a
    name: tenant-a
    adapters: [chat, "supp*"]
    base: false
  - key: key-b
    name: tenant-b
    adapters: [tenant-b]
    tokens_per_minute: 40
  - key: key-one
    name: one-at-a-time
    max_concurrency: 1
  - key: key-all
    name: platform
  - key: key-budget
    name: budgeted
    tokens_per_minute: 60
"""
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def world(tmp_path_factory, engine, tiny_chat_model_dir):
    workdir = tmp_path_factory.mktemp("public")
    (workdir / "keys.yaml").write_text(KEYS_YAML)
    keys = ApiKeys.from_file(workdir / "keys.yaml")
    with adapter_world(workdir, engine, tiny_chat_model_dir, api_keys=keys) as w:
        for key in ("chat-v1", "support-v1", "tenant-b-v1"):
            adapter = w.published[key]
            assert w.put(adapter.manifest.name, adapter).status_code == 200
        yield w


def client(world, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{world.public.url}/v1", api_key=key, max_retries=0, timeout=60)


async def engine_text(engine, prompt: list[int], adapter: str | None, max_tokens: int) -> str:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return "".join([out.text async for out in engine.add_request(prompt, sampling, adapter=adapter)])


def test_an_adapter_answer_is_the_engines_output_for_that_adapter(world, engine):
    prompt = engine.engine.tokenizer.encode("hello world")
    with client(world, "key-all") as c:
        answers = {m: c.completions.create(model=m, prompt=prompt, max_tokens=12, **GREEDY).choices[0].text
                   for m in ("chat", "support", MODEL_NAME)}  # fmt: skip
    expected = {
        "chat": asyncio.run(engine_text(engine, prompt, "chat@v1", 12)),
        "support": asyncio.run(engine_text(engine, prompt, "support@v1", 12)),
        MODEL_NAME: asyncio.run(engine_text(engine, prompt, None, 12)),
    }
    assert answers == expected
    assert len(set(answers.values())) == 3  # the adapters visibly change the answer


def test_models_lists_what_the_caller_may_use_with_versions(world):
    def listed(key: str) -> dict[str, str | None]:
        with client(world, key) as c:
            return {m.id: getattr(m, "version", None) for m in c.models.list().data}

    assert listed("key-a") == {"chat": "v1", "support": "v1"}
    assert listed("key-b") == {MODEL_NAME: None, "tenant-b": "v1"}
    assert set(listed("key-all")) == {MODEL_NAME, "chat", "support", "tenant-b"}


def test_models_retrieve_shows_one_model_the_caller_may_use(world):
    with client(world, "key-a") as c:
        card = c.models.retrieve("chat")
        assert (card.id, card.version, card.parent) == ("chat", "v1", MODEL_NAME)
        assert c.models.retrieve("chat@v1").version == "v1"  # one version by name, while loaded
        for hidden in ("tenant-b", "no-such-adapter", "chat@v9"):
            with pytest.raises(openai.NotFoundError) as caught:
                c.models.retrieve(hidden)
            assert caught.value.body["code"] == "model_not_found"
    with client(world, "key-b") as c:
        assert c.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_another_tenants_adapter_is_404_exactly_like_a_missing_one(world):
    def error_of(model: str) -> dict:
        with client(world, "key-a") as c, pytest.raises(openai.NotFoundError) as caught:
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        return caught.value.body

    hidden, missing = error_of("tenant-b"), error_of("no-such-adapter")
    assert {**hidden, "message": ""} == {**missing, "message": ""}
    assert hidden["message"].replace("tenant-b", "X") == missing["message"].replace("no-such-adapter", "X")
    with client(world, "key-a") as c, pytest.raises(openai.PermissionDeniedError):
        c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)  # this key may not use the base
    with client(world, "key-a") as c:  # a version by name works for an allowed adapter
        assert c.completions.create(model="chat@v1", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_concurrency_limit_is_429_with_retry_after(world):
    body = {"model": "chat", "prompt": "hi", "max_tokens": 150, "ignore_eos": True}
    headers = {"Authorization": "Bearer key-one"}
    post = lambda _: httpx.post(f"{world.public.url}/v1/completions", json=body, headers=headers, timeout=60)  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(post, range(4)))
    codes = sorted(a.status_code for a in answers)
    assert codes[0] == 200 and 429 in codes, codes  # one at a time: the others overlapped it
    refused = next(a for a in answers if a.status_code == 429)
    assert (
        int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    )
    assert post(0).status_code == 200  # the slot is free again


def test_tokens_per_minute_is_429_with_retry_after(world):
    headers = {"Authorization": "Bearer key-b"}
    body = {"model": "tenant-b", "prompt": "hello there", "max_tokens": 40, "ignore_eos": True}
    post = lambda: httpx.post(f"{world.public.url}/v1/completions", json=body, headers=headers, timeout=120)  # noqa: E731
    assert post().status_code == 200
    refused = post()
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
    assert "tokens per minute" in refused.json()["error"]["message"]


async def test_concurrent_requests_stay_within_tokens_per_minute_plus_one_request(world):
    """50 requests at once on a budget of 60 tokens: each reserves prompt + max_tokens as it is admitted."""
    body = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}
    headers = {"Authorization": "Bearer key-budget"}
    async with httpx.AsyncClient(base_url=world.public.url, headers=headers, timeout=120) as c:
        answers = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(50)))
    granted = [a.json()["usage"]["total_tokens"] for a in answers if a.status_code == 200]
    assert granted and all(a.status_code in (200, 429) for a in answers)
    assert all(tokens == 3 + 8 for tokens in granted)
    assert sum(granted) <= 60 + (3 + 8), sum(granted)


def test_openapi_needs_a_key_when_keys_are_configured(world):
    assert httpx.get(f"{world.public.url}/openapi.json").status_code == 401
    schema = httpx.get(f"{world.public.url}/openapi.json", headers={"Authorization": "Bearer key-a"})
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    assert not any(p.startswith("/admin") for p in schema.json()["paths"])


async def test_32_concurrent_streams_across_adapters(world):
    models = ["chat", "support", "tenant-b", MODEL_NAME]
    async with openai.AsyncOpenAI(base_url=f"{world.public.url}/v1", api_key="key-all", max_retries=0,
                                  timeout=120) as c:  # fmt: skip

        async def ask(i: int, stream: bool) -> str:
            kwargs = dict(model=models[i % 4], prompt=f"hello {i % 4}", max_tokens=8, **GREEDY)
            if not stream:
                return (await c.completions.create(**kwargs)).choices[0].text
            return "".join(
                [ch.choices[0].text async for ch in await c.completions.create(stream=True, **kwargs)]
            )

        alone = [await ask(i, stream=False) for i in range(4)]
        together = await asyncio.gather(*(ask(i, stream=True) for i in range(32)))
    assert together == [alone[i % 4] for i in range(32)]


def test_a_version_swap_during_a_stream_loop_fails_no_request(world, engine):
    assert world.put("chat", world.published["chat-v2"]).status_code == 200  # beside v1
    # v1 is unloaded during the loop: its greedy answer is taken while it is still loaded
    on_v1 = asyncio.run(engine_text(engine, engine.engine.tokenizer.encode("hi"), "chat@v1", 6))
    results, served, errors, stop = [], [], [], threading.Event()

    def loop() -> None:
        with client(world, "key-all") as c:
            while not stop.is_set():
                try:
                    raw = c.completions.with_raw_response.create(
                        model="chat", prompt="hi", max_tokens=6, stream=True, **GREEDY
                    )
                    text = "".join(ch.choices[0].text for ch in raw.parse())
                    results.append(text)
                    served.append((raw.headers.get(VERSION_HEADER), text))
                except Exception as exc:  # noqa: BLE001 - every failure is the finding
                    errors.append(repr(exc))

    threads = [threading.Thread(target=loop) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: len(results) >= 3, "streams on v1")
    switched = httpx.post(
        f"{world.admin.url}/admin/adapters/chat/alias", json={"version": "v2"}, headers=ADMIN_HEADERS
    )
    assert switched.status_code == 200
    assert world.delete("chat", "v1").status_code == 200  # in-flight v1 streams finish on v1
    count = len(results)
    wait_until(lambda: len(results) >= count + 3, "streams on v2")
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    on_v2 = asyncio.run(engine_text(engine, engine.engine.tokenizer.encode("hi"), "chat@v2", 6))
    assert results[-1] == on_v2 and set(results) <= set(results[:count]) | {on_v2}
    assert {v for v, _ in served} == {"v1", "v2"}, "the header names the version that answered"
    assert all(text == {"v1": on_v1, "v2": on_v2}[v] for v, text in served)
    assert world.put("chat", world.published["chat-v1"]).status_code == 200  # back for the other tests
    httpx.post(f"{world.admin.url}/admin/adapters/chat/alias", json={"version": "v1"}, headers=ADMIN_HEADERS)


def test_every_answer_names_its_adapter_version_and_the_base_none(world):
    messages = [{"role": "user", "content": "hi"}]
    with client(world, "key-all") as c:
        whole = c.chat.completions.with_raw_response.create(model="support", messages=messages, max_tokens=2)
        pinned = c.completions.with_raw_response.create(model="chat@v1", prompt="hi", max_tokens=2)
        base = c.completions.with_raw_response.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert whole.headers[VERSION_HEADER] == "v1" and pinned.headers[VERSION_HEADER] == "v1"
    assert VERSION_HEADER not in base.headers


def test_a_client_leaving_mid_stream_frees_its_sequence(world, engine):
    body = {"model": "support", "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer key-all"}
    slow = [True]  # each step takes 5 ms while the client reads its first line: the stream is still running
    engine.add_step_listener(lambda _stats: slow[0] and time.sleep(0.005))
    try:
        with httpx.stream(
            "POST", f"{world.public.url}/v1/completions", json=body, headers=headers, timeout=60
        ) as r:
            next(r.iter_lines())
            in_flight = lambda: next(a.in_flight for a in engine.adapters() if a.key == "support@v1")  # noqa: E731
            assert in_flight() == 1
        wait_until(lambda: in_flight() == 0 and not engine.engine.has_unfinished(), "the sequence freed")
    finally:
        slow[0] = False
    time.sleep(0.05)


def test_json_access_lines_carry_the_request_id_and_never_a_key(world):
    import logging

    from loraplane.http.logs import JsonFormatter

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("loraplane.http")
    logger.addHandler(handler)
    level, _ = logger.level, logger.setLevel(logging.INFO)
    try:
        for key, model in (("key-a", "chat"), ("key-a", "tenant-b"), ("key-all", "support")):
            httpx.post(f"{world.public.url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {key}", "X-Request-Id": f"req-{model}"})  # fmt: skip
        # The access line is written once the response went out: the client may be back first.
        wait_until(lambda: sum('"msg": "request"' in line for line in lines) == 3, "three access lines")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    access = [json.loads(line) for line in lines if '"msg": "request"' in line]
    assert {(a["request_id"], a["status"], a["key"]) for a in access} == {
        ("req-chat", 200, "tenant-a"),
        ("req-tenant-b", 404, "tenant-a"),
        ("req-support", 200, "platform"),
    }
    assert not any(key in line for line in lines for key in ("key-a", "key-all", "Bearer"))
