"""Nothing silently ignored: every request field is honoured (the output changes) or refused (400 naming it).

Each field of the OpenAI and vLLM-extension schemas is sent with a value that would change the answer and
compared with the same request without it. The tables must cover every field the request models declare, so
a field added to protocol.py without a case here fails test_every_field_has_a_case.
"""

from __future__ import annotations

import json

import httpx
import pytest

from loraplane.http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions
from tests.http.conftest import MODEL_NAME

HONOURED, LABEL, REFUSED = "honoured", "label", "refused"  # LABEL: accepted, no effect on the output
ELSEWHERE = "elsewhere"  # honoured; test_structured.py shows it on a server with room for the tools' prompt
USER = [{"role": "user", "content": "hello world"}]
GREEDY = {"temperature": 0, "max_tokens": 12}
RANDOM = {"temperature": 1.0, "seed": 3, "max_tokens": 12}

# field -> (expectation, base request fields, the field's value); shared by both endpoints
COMMON: dict[str, tuple[str, dict, object]] = {
    "temperature": (HONOURED, {**RANDOM, "temperature": 0}, 2.0),
    "top_p": (HONOURED, RANDOM, 0.05),
    "top_k": (HONOURED, RANDOM, 1),
    "seed": (HONOURED, RANDOM, 4),
    "stop": (HONOURED, GREEDY, "STOP@FIRST"),  # replaced by two characters of the greedy answer
    "n": (HONOURED, GREEDY, 2),
    "stream": (HONOURED, GREEDY, True),
    "stream_options": (HONOURED, {**GREEDY, "stream": True}, {"include_usage": True}),
    "presence_penalty": (HONOURED, GREEDY, 2.0),
    "frequency_penalty": (HONOURED, GREEDY, 2.0),
    "logit_bias": (HONOURED, GREEDY, {"7": 100}),
    "ignore_eos": (HONOURED, {**GREEDY, "logit_bias": "EOS"}, True),  # the model stops at once, unless
    "user": (LABEL, GREEDY, "someone"),
    "min_p": (HONOURED, RANDOM, 0.9),
    "repetition_penalty": (HONOURED, GREEDY, 2.0),
    "min_tokens": (HONOURED, {**GREEDY, "logit_bias": "EOS"}, 4),
    "stop_token_ids": (HONOURED, GREEDY, "ALL"),  # every token id: the answer stops at once
    "max_tokens": (HONOURED, GREEDY, 3),
    "logprobs": (HONOURED, GREEDY, None),  # per endpoint below
    "best_of": (REFUSED, GREEDY, 2),
    "use_beam_search": (REFUSED, GREEDY, True),
    "length_penalty": (REFUSED, GREEDY, 0.5),
    "include_stop_str_in_output": (REFUSED, {**GREEDY, "stop": ["a"]}, True),
    "skip_special_tokens": (REFUSED, GREEDY, False),
    "spaces_between_special_tokens": (REFUSED, GREEDY, False),
    "truncate_prompt_tokens": (REFUSED, GREEDY, 2),
    "prompt_logprobs": (REFUSED, GREEDY, 1),
    "allowed_token_ids": (REFUSED, GREEDY, [1, 2]),
    "bad_words": (REFUSED, GREEDY, ["hello"]),
    "add_special_tokens": (LABEL, GREEDY, None),  # per endpoint below
    "response_format": (HONOURED, GREEDY, {"type": "json_object"}),
    "guided_json": (HONOURED, GREEDY, {"type": "object"}),
    "guided_regex": (HONOURED, GREEDY, "a+"),
    "guided_choice": (HONOURED, GREEDY, ["yes", "no"]),
    "guided_grammar": (REFUSED, GREEDY, 'root ::= "a"'),
    "guided_decoding_backend": (REFUSED, GREEDY, "outlines"),  # "xgrammar" (ours) and "auto" pass
    "guided_whitespace_pattern": (REFUSED, GREEDY, " "),
    "structural_tag": (REFUSED, GREEDY, "{}"),
    "structured_outputs": (REFUSED, GREEDY, {"regex": "a+"}),
    "priority": (REFUSED, GREEDY, 5),
    "request_id": (REFUSED, GREEDY, "mine"),
    "logits_processors": (REFUSED, GREEDY, ["x.y"]),
    "return_tokens_as_token_ids": (REFUSED, GREEDY, True),
    "return_token_ids": (REFUSED, GREEDY, True),
    "cache_salt": (REFUSED, GREEDY, "salt"),
    "kv_transfer_params": (REFUSED, GREEDY, {"a": 1}),
    "vllm_xargs": (REFUSED, GREEDY, {"a": 1}),
}
CHAT: dict[str, tuple[str, dict, object]] = {
    **COMMON,
    "model": (HONOURED, GREEDY, "no-such-model"),  # 404 naming model: test_openai_api covers it
    "messages": (HONOURED, GREEDY, [{"role": "user", "content": "something else entirely"}]),
    "max_completion_tokens": (HONOURED, GREEDY, 3),
    "logprobs": (HONOURED, GREEDY, True),
    "top_logprobs": (HONOURED, {**GREEDY, "logprobs": True}, 3),
    "metadata": (LABEL, GREEDY, {"team": "a"}),
    "safety_identifier": (LABEL, GREEDY, "user-1"),
    "prompt_cache_key": (LABEL, GREEDY, "k"),
    "add_generation_prompt": (HONOURED, GREEDY, False),
    "continue_final_message": (
        HONOURED,
        {
            **GREEDY,
            "add_generation_prompt": False,
            "messages": [*USER, {"role": "assistant", "content": "so"}],
        },
        True,
    ),  # fmt: skip
    "add_special_tokens": (LABEL, GREEDY, True),  # this tokenizer has no special tokens of its own to add
    "tools": (ELSEWHERE, GREEDY, None),
    "tool_choice": (ELSEWHERE, GREEDY, None),
    "parallel_tool_calls": (REFUSED, GREEDY, False),  # without tools (as OpenAI); with tools: ELSEWHERE
    "functions": (REFUSED, GREEDY, [{"name": "f", "parameters": {}}]),
    "function_call": (REFUSED, GREEDY, "auto"),
    "audio": (REFUSED, GREEDY, {"voice": "alloy", "format": "wav"}),
    "modalities": (REFUSED, GREEDY, ["text", "audio"]),
    "moderation": (REFUSED, GREEDY, {"input": {"policy": "x"}}),
    "prediction": (REFUSED, GREEDY, {"type": "content", "content": "x"}),
    "prompt_cache_options": (REFUSED, GREEDY, {"ttl": "24h"}),
    "prompt_cache_retention": (REFUSED, GREEDY, "24h"),
    "reasoning_effort": (REFUSED, GREEDY, "high"),
    "service_tier": (REFUSED, GREEDY, "priority"),
    "store": (REFUSED, GREEDY, True),
    "verbosity": (REFUSED, GREEDY, "low"),
    "web_search_options": (REFUSED, GREEDY, {}),
    "echo": (REFUSED, GREEDY, True),
    "documents": (REFUSED, GREEDY, [{"text": "x"}]),
    "chat_template": (REFUSED, GREEDY, "{{ messages }}"),
    "chat_template_kwargs": (REFUSED, GREEDY, {"enable_thinking": True}),
    "mm_processor_kwargs": (REFUSED, GREEDY, {"a": 1}),
}
COMPLETION: dict[str, tuple[str, dict, object]] = {
    **COMMON,
    "model": (HONOURED, GREEDY, "no-such-model"),
    "prompt": (HONOURED, GREEDY, "something else entirely"),
    "logprobs": (HONOURED, GREEDY, 2),
    "echo": (HONOURED, GREEDY, True),
    "suffix": (REFUSED, GREEDY, " the end"),
    "prompt_embeds": (REFUSED, GREEDY, "AAAA"),
    "add_special_tokens": (LABEL, GREEDY, False),
}
MESSAGE: dict[str, object] = {  # each refused when set, naming messages[0].<field>
    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    "tool_call_id": "c",
    "function_call": {"name": "f", "arguments": "{}"},
    "refusal": "no",
    "audio": {"id": "a"},
    "annotations": [{"type": "url_citation"}],
}
STREAM_OPTIONS: dict[str, tuple[str, object]] = {
    "include_usage": (HONOURED, True),
    "continuous_usage_stats": (HONOURED, True),
    "include_obfuscation": (REFUSED, True),
}


def test_every_field_has_a_case():
    assert set(CHAT) == set(ChatCompletionRequest.model_fields)
    assert set(COMPLETION) == set(CompletionRequest.model_fields)
    assert set(MESSAGE) | {"role", "content", "name"} == set(ChatMessage.model_fields)
    assert set(STREAM_OPTIONS) == set(StreamOptions.model_fields)


def _post(server, path: str, body: dict) -> tuple[int, object]:
    """(status, the answer without its per-request ids: JSON, or the list of SSE chunks)."""
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        chunks = [json.loads(e[6:]) for e in response.text.split("\n\n") if e.startswith("data: {")]
        return response.status_code, [
            {k: v for k, v in c.items() if k not in ("id", "created")} for c in chunks
        ]
    data = response.json()
    if response.status_code == 200:
        data = {k: v for k, v in data.items() if k not in ("id", "created")}
    return response.status_code, data


def _resolve(value, answer: str, eos: int, vocab: int):
    if value == "STOP@FIRST":
        assert len(answer) >= 4, answer
        return [answer[1:3]]
    if value == "ALL":
        return list(range(vocab))
    if value == "EOS":
        return {str(eos): 100}
    return value


def _check(server, engine, path: str, field: str, case: tuple[str, dict, object], first: dict) -> None:
    expectation, base_fields, value = case
    if expectation == ELSEWHERE:
        from tests.http.test_structured import FIELDS_SHOWN_HONOURED

        assert field in FIELDS_SHOWN_HONOURED
        return
    tokenizer = engine.engine.tokenizer
    eos, vocab = tokenizer.eos_token_id, engine.info().vocab_size
    base = {"model": MODEL_NAME, **first, **base_fields}
    base = {k: _resolve(v, "", eos, vocab) if k == "logit_bias" else v for k, v in base.items()}
    status, plain = _post(server, path, base)
    assert status == 200, plain
    answer = plain[0]["choices"][0] if isinstance(plain, list) else plain["choices"][0]
    text = answer.get("text") or (answer.get("message") or {}).get("content") or ""
    status, changed = _post(server, path, {**base, field: _resolve(value, text, eos, vocab)})
    if expectation == REFUSED:
        assert status == 400 and changed["error"]["param"] == field, (field, changed)
    elif expectation == LABEL:
        assert status == 200 and changed == plain, (field, changed)
    elif field == "model":
        assert status == 404 and changed["error"]["param"] == "model"
    else:
        assert status == 200 and changed != plain, (field, "had no effect")


@pytest.mark.parametrize("field", sorted(CHAT))
def test_chat_field_is_honoured_or_refused(server, engine, field):
    _check(server, engine, "chat/completions", field, CHAT[field], {"messages": USER})


@pytest.mark.parametrize("field", sorted(COMPLETION))
def test_completion_field_is_honoured_or_refused(server, engine, field):
    _check(server, engine, "completions", field, COMPLETION[field], {"prompt": "hello world"})


@pytest.mark.parametrize("field", sorted(MESSAGE))
def test_message_field_is_refused_when_set(server, field):
    messages = [{**USER[0], field: MESSAGE[field]}]
    status, error = _post(server, "chat/completions", {"model": MODEL_NAME, "messages": messages, **GREEDY})
    assert status == 400 and error["error"]["param"] == f"messages[0].{field}", error
    # null, as a client echoing back an assistant message sends them, is fine
    status, _ = _post(server, "chat/completions", {"model": MODEL_NAME, **GREEDY,
                                                    "messages": [{**USER[0], field: None}]})  # fmt: skip
    assert status == 200


@pytest.mark.parametrize("field", sorted(STREAM_OPTIONS))
def test_stream_option_is_honoured_or_refused(server, field):
    expectation, value = STREAM_OPTIONS[field]
    base = {"model": MODEL_NAME, "prompt": "hello world", **GREEDY, "stream": True}
    status, plain = _post(server, "completions", base)
    status, changed = _post(server, "completions", {**base, "stream_options": {field: value}})
    if expectation == REFUSED:
        assert status == 400 and changed["error"]["param"] == f"stream_options.{field}", changed
    else:
        assert status == 200 and changed != plain


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_unknown_field_is_refused_by_name(server, path):
    first = {"messages": USER} if path.startswith("chat") else {"prompt": "hi"}
    status, error = _post(server, path, {"model": MODEL_NAME, **first, "frobnicate": 1})
    assert status == 400 and error["error"]["param"] == "frobnicate"
    assert "unknown field" in error["error"]["message"]


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_stream_options_without_stream_is_400(server, path):
    first = {"messages": USER} if path.startswith("chat") else {"prompt": "hi"}
    body = {"model": MODEL_NAME, **first, "stream_options": {"include_usage": True}}
    status, error = _post(server, path, body)
    assert status == 400 and error["error"]["param"] == "stream_options", error
    status, _ = _post(server, path, {**body, "stream": False})
    assert status == 400
