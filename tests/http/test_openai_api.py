"""The OpenAI API through the official client, on a real uvicorn serving a tiny random Llama on CPU."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.http.conftest import MAX_MODEL_LEN, MODEL_NAME

USER = [{"role": "user", "content": "hello world"}]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def chat(client, **kwargs):
    params = {"model": MODEL_NAME, "messages": USER, "max_tokens": 8, **GREEDY}
    return client.chat.completions.create(**{**params, **kwargs})


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].owned_by == "loraplane"


def test_chat_completion_uses_the_chat_template_and_reports_usage(client, engine):
    tokenizer = engine.engine.tokenizer
    rendered = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    prompt_len = len(tokenizer.encode(rendered, add_special_tokens=False))
    response = chat(client, max_tokens=8)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == MODEL_NAME
    assert response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == prompt_len
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == prompt_len + 8


def test_chat_stream_matches_the_whole_answer(client):
    whole = chat(client, max_tokens=12).choices[0].message.content
    chunks = list(chat(client, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_max_completion_tokens_is_the_budget_too(client):
    response = chat(client, max_tokens=None, max_completion_tokens=3)
    assert response.usage.completion_tokens == 3


def test_chat_without_max_tokens_may_use_all_the_room_left(client):
    response = chat(client, max_tokens=None)
    assert response.usage.total_tokens == MAX_MODEL_LEN and response.choices[0].finish_reason == "length"


def test_completion_accepts_a_string_or_its_token_ids(client, engine):
    prompt = "The capital of France is"
    ids = engine.engine.tokenizer.encode(prompt)
    by_text = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, **GREEDY)
    assert by_text.object == "text_completion" and by_text.choices[0].finish_reason == "length"
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 6


def test_completion_stream_matches_the_whole_answer(client):
    kwargs = dict(model=MODEL_NAME, prompt="hello tokens", max_tokens=10, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_defaults_to_16_tokens(client):
    response = client.completions.create(model=MODEL_NAME, prompt="hello", **GREEDY)
    assert response.usage.completion_tokens == 16


def test_seeded_sampling_repeats(client):
    first, second, other = (
        chat(client, temperature=1.0, seed=seed, max_tokens=16).choices[0].message.content
        for seed in (7, 7, 8)
    )
    assert first == second
    assert first != other


def test_stop_string_cuts_the_answer(client):
    whole = chat(client, max_tokens=24).choices[0].message.content
    # Two characters from the middle that are whole characters (random weights emit stray UTF-8 bytes).
    starts = [i for i in range(len(whole) // 2, len(whole) - 1) if "\ufffd" not in whole[i : i + 2]]
    assert starts, whole
    stop = whole[starts[0] : starts[0] + 2]
    response = chat(client, max_tokens=24, stop=[stop])
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content == whole[: whole.index(stop)]


def test_four_stop_strings_of_4096_characters_are_accepted(client):
    stops = ["x" * 4093, "[", "]", "}"]
    assert chat(client, max_tokens=2, stop=stops).choices[0].finish_reason in ("length", "stop")


def test_chat_logprobs_are_the_sampled_and_top_tokens(client):
    response = chat(client, max_tokens=5, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.logprob == pytest.approx(tops[0])  # greedy picks the likeliest
        assert token.logprob <= 0.0 and token.bytes == list(token.token.encode())


def test_completion_logprobs(client):
    response = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4, logprobs=2, **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias.1"),
        ({"extra_body": {"min_tokens": 9}, "max_tokens": 8}, "min_tokens"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"max_tokens": None, "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["x" * 4000, "y" * 97]}, "stop"),
        ({"stop": "x" * 4097}, "stop"),
        ({"messages": [{"role": "user", "content": "x " * MAX_MODEL_LEN}]}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ],
)
def test_bad_chat_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, **kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 10**6]}, "prompt"),
        ({"prompt": list(range(3)) * MAX_MODEL_LEN}, "prompt"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"stop": [str(i) for i in range(1000)]}, "stop"),
    ],
)
def test_bad_completion_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, **kwargs})
    assert caught.value.body["param"] == param, caught.value.body


def test_unknown_model_is_404_naming_model(client):
    with pytest.raises(openai.NotFoundError) as caught:
        chat(client, model="no-such-model")
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")


def test_context_length_error_says_the_limit(client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=MAX_MODEL_LEN)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in caught.value.body["message"]


async def test_concurrent_requests_each_get_their_own_answer(server):
    prompts = [f"hello {word}" for word in ("world", "tokens", "café", "Paris", "again", "vu")]
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:

        async def ask(prompt: str, stream: bool) -> str:
            kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, **GREEDY)
            if not stream:
                return (await client.completions.create(**kwargs)).choices[0].text
            return "".join(
                [c.choices[0].text async for c in await client.completions.create(stream=True, **kwargs)]
            )

        alone = [await ask(p, stream=False) for p in prompts]
        together = await asyncio.gather(*(ask(p, stream=i % 2 == 0) for i, p in enumerate(prompts)))
    assert together == alone
