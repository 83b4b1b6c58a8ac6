"""n choices per request: n engine requests on one prompt, the later ones on the first one's cached prompt."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.http.conftest import MODEL_NAME, wait_until

USER = [{"role": "user", "content": "hello world"}]
NO_EOS = {"ignore_eos": True}


def test_n_greedy_choices_are_indexed_and_usage_counts_the_prompt_once(client):
    one = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0,
                                         extra_body=NO_EOS)  # fmt: skip
    three = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0, n=3,
                                           extra_body=NO_EOS)  # fmt: skip
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 6


def test_seeded_choice_i_is_the_request_with_seed_plus_i(client):
    kwargs = dict(model=MODEL_NAME, prompt="hello world", max_tokens=8, temperature=1.0, extra_body=NO_EOS)
    many = client.completions.create(n=3, seed=11, **kwargs)
    alone = [client.completions.create(seed=11 + i, **kwargs).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == alone
    assert len(set(alone)) == 3


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_choices_assemble_to_the_whole_answer(client, endpoint):
    common = dict(model=MODEL_NAME, max_tokens=7, temperature=1.0, seed=5, n=2, extra_body=NO_EOS)
    if endpoint == "chat":
        create, first = client.chat.completions.create, {"messages": USER}
    else:
        create, first = client.completions.create, {"prompt": "hello world"}
    whole = create(**first, **common)
    texts, finishes, usage = {}, {}, None
    for chunk in create(**first, **common, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.delta.content if endpoint == "chat" else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    expected = [c.message.content if endpoint == "chat" else c.text for c in whole.choices]
    assert [texts[0], texts[1]] == expected
    assert finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 14 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_later_choices_reuse_the_first_ones_prompt_blocks(client, engine):
    block = engine.engine.scheduler.block_manager.block_size
    prompt = list(range(40, 40 + 3 * block + 1))  # 3 full blocks, then one more token
    before = engine.engine.stats().prefix_cache_hit_tokens
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, n=4, temperature=0,
                                         extra_body=NO_EOS)  # fmt: skip
    hits = engine.engine.stats().prefix_cache_hit_tokens - before
    assert len(response.choices) == 4
    assert hits >= 3 * 3 * block  # choices 1..3 each found the 3 full prompt blocks cached


def test_a_client_leaving_aborts_every_choice(server, engine):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 200, "n": 3, "stream": True, **NO_EOS}
    seen: set[int] = set()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                request_id = chunk["id"]
                seen.update(c["index"] for c in chunk["choices"])
            if seen == {0, 1, 2}:
                break
    children = {f"{request_id}-{i}" for i in range(3)}
    wait_until(lambda: children <= set(engine.aborted), "every choice's abort")
    wait_until(lambda: not engine.engine.has_unfinished(), "the engine going idle")


def test_later_choices_start_on_the_first_ones_version_while_it_unloads(tiny_chat_model_dir, tmp_path):
    """The extra choices start after choice 0's first token. Here the version's unload begins exactly then
    (before choice 1 is submitted): the request's lease keeps it, every choice finishes on it, and the
    version is freed once the request is done."""
    from loraplane.engine.core.async_engine import AsyncEngine
    from loraplane.engine.core.config import EngineConfig
    from loraplane.engine.core.llm_engine import LLMEngine
    from loraplane.http.app import create_app
    from loraplane.serve.main import load_tokenizer
    from loraplane.serve.sources import open_local_folder
    from tests.adapter_factory import make_peft_folder
    from tests.http.conftest import MAX_MODEL_LEN, ServerThread

    class UnloadsBeforeLaterChoices(AsyncEngine):
        def add_request(self, prompt, sampling=None, request_id=None, adapter=None, lease=None):
            if adapter is not None and request_id is not None and request_id.endswith("-1"):
                self.engine.adapters.mark_unloading(*adapter.split("@"))
            return super().add_request(prompt, sampling, request_id, adapter, lease)

    tokenizer = load_tokenizer(str(tiny_chat_model_dir))
    config = EngineConfig(model=str(tiny_chat_model_dir), device="cpu", dtype="float32",
                          max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)  # fmt: skip
    engine = UnloadsBeforeLaterChoices(LLMEngine(config, tokenizer=tokenizer))
    try:
        base = json.loads((tiny_chat_model_dir / "config.json").read_text())
        local = open_local_folder(make_peft_folder(tmp_path / "a", base_config=base, rank=4, seed=9), None,
                                  engine.info())  # fmt: skip

        async def load():
            await engine.load_adapter("leased", local.version, local.path, local.digest)
            await engine.set_alias("leased", local.version)

        asyncio.run(load())
        with ServerThread(create_app(engine, tokenizer, MODEL_NAME)) as server:
            answer = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": "leased", "prompt": "hello", "max_tokens": 5, "n": 3, "temperature": 0, **NO_EOS})  # fmt: skip
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert len(body["choices"]) == 3 and body["usage"]["completion_tokens"] == 15
            assert len({c["text"] for c in body["choices"]}) == 1  # greedy: one version answered all three
            wait_until(lambda: not engine.engine.adapters.is_registered(f"leased@{local.version}"),
                       "the version freed after the request")  # fmt: skip
    finally:
        engine.close()
