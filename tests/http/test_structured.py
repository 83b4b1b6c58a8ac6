"""Structured output and tool calling through the official ``openai`` client, on a real uvicorn serving a tiny
random Llama on CPU with the real grammar library (xgrammar).

Random weights produce no JSON by themselves: every answer that parses and validates here does so because the
grammar held it there. The tool prompts are long (the Hermes system prompt), so this module serves its own engine
with a larger context than the shared one.
"""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from tests.engine.conftest import build_tiny_hf_model
from tests.engine.peft_adapters import save_peft_adapter
from tests.http.conftest import MODEL_NAME, ServerThread, build_chat_tokenizer

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MAX_MODEL_LEN = 2048
ADAPTER = "weather-bot"
USER = [{"role": "user", "content": "hello world"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "units": {"enum": ["celsius", "fahrenheit"]},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "days", "units", "rain"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA},
}
FIELDS_SHOWN_HONOURED = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)  # test_fields.py defers to this module
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}


@pytest.fixture(scope="module")
def long_chat_model_dir(tmp_path_factory):
    """The shared tiny chat model's recipe with room for a long prompt."""
    out = tmp_path_factory.mktemp("tiny-chat-llama-long")
    tokenizer = build_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    build_tiny_hf_model(out, "llama", vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None,
                        pad_token_id=None, max_position_embeddings=MAX_MODEL_LEN)  # fmt: skip
    tokenizer.save_pretrained(out)
    return out


async def serve_local_adapter(engine, name: str, folder) -> None:
    """As ``loraplane serve --adapter name=DIR`` does before serving."""
    from loraplane.serve.sources import open_local_folder

    local = open_local_folder(folder, None, engine.info())
    await engine.load_adapter(name, local.version, local.path, local.digest)
    await engine.warm_adapter(name, local.version, gpu=True)
    await engine.set_alias(name, local.version)


@pytest.fixture(scope="module")
def big_server(long_chat_model_dir, tmp_path_factory):
    tiny_chat_model_dir = long_chat_model_dir
    from loraplane.engine.core.async_engine import AsyncEngine
    from loraplane.engine.core.config import EngineConfig
    from loraplane.engine.core.llm_engine import LLMEngine
    from loraplane.http.app import create_app
    from loraplane.serve.main import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_chat_model_dir))
    config = EngineConfig(model=str(tiny_chat_model_dir), device="cpu", dtype="float32",
                          max_model_len=MAX_MODEL_LEN, num_kv_blocks=512)  # fmt: skip
    engine = AsyncEngine(LLMEngine(config, tokenizer=tokenizer))
    adapter_dir = save_peft_adapter(long_chat_model_dir, tmp_path_factory.mktemp("adapter") / ADAPTER, seed=3, r=8,
                                    target_modules=["q_proj", "v_proj"])  # fmt: skip
    try:
        asyncio.run(serve_local_adapter(engine, ADAPTER, adapter_dir))
        with ServerThread(create_app(engine, tokenizer, MODEL_NAME)) as running:
            yield running
    finally:
        engine.close()


@pytest.fixture
def client(big_server):
    with openai.OpenAI(base_url=f"{big_server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(client, **kwargs):
    params = {"model": MODEL_NAME, "messages": USER, "max_tokens": 120, "temperature": 0.0}
    return client.chat.completions.create(**{**params, **kwargs})


def json_schema_format(schema=SCHEMA, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": strict}}


def test_json_schema_answers_validate(client):
    for seed in range(3):
        response = chat(client, temperature=1.0, seed=seed, response_format=json_schema_format())
        choice = response.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_an_adapter_and_the_base_in_one_batch_both_validate(client):
    results = {}

    def run(model):
        results[model] = chat(client, model=model, response_format=json_schema_format()).choices[0]

    threads = [threading.Thread(target=run, args=(m,)) for m in (MODEL_NAME, ADAPTER)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for choice in results.values():
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert results[MODEL_NAME].message.content != results[ADAPTER].message.content  # the adapter ran
    call = chat(client, model=ADAPTER, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call_args(call.choices[0].message.tool_calls[0], SCHEMA)


def test_json_schema_stream_matches_the_whole_answer(client):
    whole = chat(client, response_format=json_schema_format()).choices[0].message.content
    chunks = list(chat(client, response_format=json_schema_format(), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_answers_parse_as_objects(client):
    # A closing quote or brace is rare under random weights; the bias makes closing likely wherever the
    # grammar allows it (and cannot make invalid JSON: the mask comes after the bias).
    ids = build_chat_tokenizer().encode('"}', add_special_tokens=False)
    bias = {str(i): 8 for i in ids}
    for seed in range(3):
        response = chat(client, temperature=1.0, seed=seed, max_tokens=200,
                        response_format={"type": "json_object"}, logit_bias=bias)  # fmt: skip
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_completions_take_response_format_and_guided_fields(client):
    kw = dict(model=MODEL_NAME, prompt="hello", max_tokens=120, temperature=0.0)
    out = client.completions.create(**kw, extra_body={"response_format": json_schema_format()})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    out = client.completions.create(**kw, extra_body={"guided_choice": ["yes", "no", "maybe so"]})
    assert out.choices[0].text in ("yes", "no", "maybe so") and out.choices[0].finish_reason == "stop"
    out = client.completions.create(**kw, extra_body={"guided_regex": r"[a-c]{2}-\d{3}"})
    text = out.choices[0].text
    assert len(text) == 6 and set(text[:2]) <= set("abc") and text[2] == "-" and text[3:].isdigit()


def test_a_constrained_and_a_plain_request_at_once(client):
    alone = chat(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    results = {}

    def run(name, **kwargs):
        results[name] = chat(client, **kwargs).choices[0].message.content

    threads = [
        threading.Thread(target=run, args=("json",), kwargs=dict(response_format=json_schema_format())),
        threading.Thread(
            target=run, args=("plain",), kwargs=dict(max_tokens=24, extra_body={"ignore_eos": True})
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["plain"] == alone
    jsonschema.validate(json.loads(results["json"]), SCHEMA)


def call_args(call, schema) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_named_tool_choice_returns_a_valid_call(client):
    response = chat(client, tools=[WEATHER, CLOCK],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    call_args(call, SCHEMA)


def test_required_tool_choice_returns_calls_of_listed_tools(client):
    for seed in range(2):
        response = chat(client, tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0, seed=seed,
                        parallel_tool_calls=False)  # fmt: skip
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        schema = SCHEMA if call.function.name == "get_weather" else {"type": "object", "maxProperties": 0}
        call_args(call, schema)


def test_streamed_tool_call_assembles_as_the_whole_answer(client):
    kwargs = dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = chat(client, **kwargs).choices[0].message.tool_calls[0]
    chunks = list(chat(client, stream=True, **kwargs))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"] and deltas[0].index == 0
    assert json.loads(deltas[0].function.arguments) == json.loads(whole.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_tool_round_trip(client):
    first = (
        chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).choices[0].message
    )
    call = first.tool_calls[0]
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    response = chat(client, messages=messages, tools=[WEATHER], max_tokens=8)
    assert response.choices[0].finish_reason in ("length", "stop", "tool_calls")
    plain = chat(client, messages=USER, tools=[WEATHER], max_tokens=8)
    assert (
        response.usage.prompt_tokens > plain.usage.prompt_tokens
    )  # the call and its result are in the prompt


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(response_format=json_schema_format({"type": "array", "uniqueItems": True})),
         "response_format.json_schema.schema.uniqueItems"),
        (dict(response_format=json_schema_format({"type": "object", "properties": {"a": {"not": {}}}})),
         "response_format.json_schema.schema.properties.a.not"),
        (dict(response_format=json_schema_format({"type": "string", "format": "iri"})),
         "response_format.json_schema.schema.format"),
        (dict(response_format={"type": "grammar"}), "response_format.type"),
        (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex"),
        (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}]),
         "tools[0].function.parameters.if"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
         "response_format"),
        (dict(response_format={"type": "json_object"}, extra_body={"min_tokens": 3}), "min_tokens"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
    ],
)  # fmt: skip
def test_unsupported_requests_are_refused_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_tools_tool_choice_and_parallel_tool_calls_change_the_answer(client):
    """What test_fields.py checks for every other field (its server has no room for the tools' prompt)."""
    plain = chat(client, max_tokens=12, extra_body={"ignore_eos": True})
    with_tools = chat(client, max_tokens=12, tools=[WEATHER], extra_body={"ignore_eos": True})
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    assert with_tools.choices[0].message.content != plain.choices[0].message.content
    assert with_tools.choices[0].message.tool_calls is None  # auto: nothing call-shaped in random text
    forced = chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert forced.choices[0].message.tool_calls and forced.choices[0].message.content is None
    many = chat(client, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=1, max_tokens=400)
    one = chat(client, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=1, max_tokens=400,
               parallel_tool_calls=False)  # fmt: skip
    assert len(one.choices[0].message.tool_calls) == 1
    assert many.choices[0].message != one.choices[0].message


def test_auto_with_a_strict_function_holds_calls_to_its_schema():
    """Free text stays free; after <tool_call> the strict function's arguments keep to its schema, another
    tool's to an object (random weights seldom write the tag, so the grammar is checked on strings)."""
    from loraplane.http import tools
    from loraplane.http.protocol import ChatCompletionRequest
    from loraplane.http.structured import Grammars

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    spec = tools.plan(ChatCompletionRequest(model=MODEL_NAME, messages=USER, tools=[strict, CLOCK])).spec
    tokenizer = build_chat_tokenizer()
    grammar = Grammars().compile(spec, tokenizer, len(tokenizer))
    weather = '{"city": "Oslo", "days": 2, "units": "celsius", "rain": false}'
    good = (f'So: <tool_call>\n{{"name": "get_weather", "arguments": {weather}}}\n</tool_call> and '
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')  # fmt: skip
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for text, valid in ((good, True), ("just words", True), (bad, False)):
        matcher = grammar.matcher((tokenizer.eos_token_id,))  # free text: no printable-only wrapper
        assert matcher.accept_string(text) is valid, text
    assert tools.plan(ChatCompletionRequest(model=MODEL_NAME, messages=USER, tools=[WEATHER])).spec is None
