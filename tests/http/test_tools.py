"""Tool calling without a server: the prompt a template gets, the calls parsed from answers, the streamed
deltas of an ``auto`` answer, and the grammar of ``required``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from loraplane.http import tools
from loraplane.http.errors import APIError
from loraplane.http.protocol import ChatCompletionRequest
from loraplane.http.renderers import ChatStream, Head
from loraplane.http.streaming import Usages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ROUND_TRIP = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


def request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": ROUND_TRIP, "tools": [WEATHER], **kwargs})


def test_templates_without_tools_get_the_hermes_format_written_out():
    body = request()
    turns = tools.conversation(body, tools.plan(body), native=False)
    assert turns[0]["role"] == "system" and json.dumps(WEATHER) in turns[0]["content"]
    assert "<tool_call>" in turns[0]["content"]
    assert turns[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                        '{"city": "Paris"}}\n</tool_call>'}  # fmt: skip
    assert turns[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}


def test_templates_with_tools_get_transformers_message_shapes():
    body = request()
    turns = tools.conversation(body, tools.plan(body), native=True)
    assert turns[0] == ROUND_TRIP[0]  # no system prompt of ours: the template renders the tools
    call = turns[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert turns[2] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1", "name": "get_weather"}


def test_a_template_with_tools_renders_them():
    from loraplane.http.checks import chat_prompt
    from tests.http.conftest import build_chat_tokenizer

    tok = build_chat_tokenizer()
    tok.chat_template = (
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
        "{% if m.tool_calls %}{{ m.tool_calls[0].function | tojson }}{% else %}{{ m.content }}{% endif %}\n"
        "{% endfor %}"
    )
    body = request()
    text = tok.decode(chat_prompt(tok, body, tools.plan(body)))
    assert text.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    assert 'assistant: {"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "tool: 21 C" in text


def test_auto_parses_hermes_blocks_and_bare_calls():
    plan = tools.plan(request())
    content, calls = tools.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo"}}\n</tool_call>', plan)  # fmt: skip
    assert content == "Let me check." and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    two = (
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Bern"}}</tool_call>'
    )
    assert len(tools.parse(two, plan)[1]) == 2
    assert len(tools.parse(two, tools.plan(request(parallel_tool_calls=False)))[1]) == 1
    content, calls = tools.parse('{"name": "get_weather", "parameters": {"city": "Rome"}}', plan)
    assert content is None and json.loads(calls[0].function.arguments) == {"city": "Rome"}
    for text in ("plain words", '<tool_call>{"name": "other", "arguments": {}}</tool_call>', "<tool_call>{"):
        assert tools.parse(text, plan) == (text, [])


def test_none_renders_and_parses_nothing():
    plan = tools.plan(request(tool_choice="none"))
    assert plan.tools == [] and not plan.parses
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert tools.parse(text, plan) == (text, [])


def test_required_grammar_moves_each_tools_defs_to_the_root():
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": {
        "type": "object", "properties": {"near": {"$ref": "#/$defs/Place"}}}}}  # fmt: skip
    other = {"type": "function", "function": {"name": "visit", "parameters": params}}
    plan = tools.plan(request(tools=[WEATHER, other], tool_choice="required", parallel_tool_calls=False))
    schema = plan.spec.value
    assert schema["maxItems"] == 1 and set(schema["$defs"]) == {"t1_Place"}
    visit = schema["items"]["anyOf"][1]["properties"]["arguments"]
    assert visit["properties"]["at"] == {"$ref": "#/$defs/t1_Place"}
    assert schema["$defs"]["t1_Place"]["properties"]["near"] == {"$ref": "#/$defs/t1_Place"}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
        (dict(tools=[WEATHER, WEATHER]), "tools"),
        (dict(tools=None, tool_choice="auto"), "tool_choice"),
        (dict(tools=None, parallel_tool_calls=True), "parallel_tool_calls"),
    ],
)
def test_inconsistent_tool_requests_name_the_field(kwargs, param):
    with pytest.raises(APIError) as info:
        tools.plan(request(**kwargs))
    assert info.value.param == param


def out(text: str, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(text=text, finished=finished, finish_reason="stop" if finished else None,
                           stop_reason=None, new_token_ids=[1], logprobs=None)  # fmt: skip


def test_auto_streams_content_until_a_tool_call_then_the_call_whole():
    stream = ChatStream(Head("id", "m", 0, Usages()), 0, None, None, tools.plan(request()))
    pieces = [
        "Sure",
        " thing <",
        "tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {"city": "Oslo"}}',
        "</tool_call>",
    ]
    chunks = [json.loads(c) for piece in pieces[:-1] for c in stream(out(piece))]
    chunks += [json.loads(c) for c in stream(out(pieces[-1], finished=True))]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Sure thing "  # "<" waited until it was clear it opened a call
    (call,) = next(d["tool_calls"] for d in deltas if "tool_calls" in d)
    assert call["index"] == 0 and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_stream_without_a_call_sends_every_character():
    stream = ChatStream(Head("id", "m", 0, Usages()), 0, None, None, tools.plan(request()))
    pieces = ["a <b", "> <tool", "s"]
    chunks = [json.loads(c) for p in pieces[:-1] for c in stream(out(p))]
    chunks += [json.loads(c) for c in stream(out(pieces[-1], finished=True))]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "a <b> <tools"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_server_imports_no_grammar_library_until_a_request_needs_one():
    import subprocess
    import sys

    code = (
        "import sys, loraplane.engine.core.llm_engine, loraplane.http.app, loraplane.serve.main; "
        "assert 'xgrammar' not in sys.modules, 'imported at start'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_structured_output_without_xgrammar_is_a_400_naming_the_field(monkeypatch):
    import sys

    from loraplane.http.structured import Grammars, Spec

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as on an image without the structured extra
    with pytest.raises(APIError) as info:
        Grammars().compile(Spec("json_object", {"type": "object"}, "response_format"), object(), 64)
    assert info.value.param == "response_format" and "loraplane[structured]" in info.value.message
