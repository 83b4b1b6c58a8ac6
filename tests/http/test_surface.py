"""The rest of the OpenAI surface: models.retrieve, echo, logprobs that end before the stop token."""

from __future__ import annotations

import openai
import pytest

from tests.http.conftest import MODEL_NAME

GREEDY = {"temperature": 0.0}


def test_models_retrieve(client):
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["param"] == "model"


@pytest.mark.parametrize("prompt", ["hello world", [[104, 101, 108]]])
def test_echo_puts_the_prompt_before_the_answer(client, engine, prompt):
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=6, **GREEDY)
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(echo=True, **kwargs)
    text = prompt if isinstance(prompt, str) else engine.engine.tokenizer.decode(prompt[0])
    assert echoed.choices[0].text == text + plain
    assert echoed.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kwargs))
    assert streamed == text + plain


def test_echo_with_logprobs_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, echo=True, logprobs=1)
    assert caught.value.body["param"] == "echo"


def test_suffix_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, suffix="end")
    assert caught.value.body["param"] == "suffix"


def test_logprobs_do_not_list_the_stop_token(client, engine):
    """Stopped by a stop token (here: every token id is one), the answer holds no text and logprobs no entry,
    while usage counts the token and stop_reason names it (as vLLM)."""
    every = list(range(engine.info().vocab_size))
    extra = {"stop_token_ids": every}
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, logprobs=True,
                                          extra_body=extra, **GREEDY)  # fmt: skip
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == ""
    assert choice.logprobs.content == [] and chat.usage.completion_tokens == 1
    assert choice.model_extra["stop_reason"] in every
    done = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4, logprobs=1,
                                     extra_body=extra, **GREEDY)  # fmt: skip
    assert done.choices[0].logprobs.tokens == [] and done.choices[0].text == ""
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                                 logprobs=True, stream=True, extra_body=extra, **GREEDY))  # fmt: skip
    assert all(c.choices[0].logprobs is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_of_an_answer_cut_by_length_list_every_token(client):
    response = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=5, logprobs=0,
                                         extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
