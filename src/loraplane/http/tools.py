"""Tool calling for chat completions: ``tools`` into the prompt, ``tool_choice`` enforced, calls parsed out.

The prompt: a chat template that knows tools (its source mentions ``tools``: Qwen2.5, Llama 3.x, Hermes) gets
them through ``apply_chat_template(tools=...)``, with assistant ``tool_calls`` and ``tool`` messages as
transformers expects them. Any other template (SmolLM2's, plain ones) gets the Hermes format written out: a
system prompt listing the tools as JSON inside ``<tools></tools>`` and asking for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; earlier calls are rendered in that format and tool
results come back as user turns inside ``<tool_response></tool_response>``.

``tool_choice``: ``none`` renders no tools and parses nothing; ``auto`` (the default with tools) parses Hermes
``<tool_call>`` blocks, or an answer that is one bare ``{"name": ..., "arguments"|"parameters": ...}`` object
(Llama 3.x), naming a listed tool (with ``strict`` functions, a grammar lets the text run free until
``<tool_call>``, then holds the call to a strict function's schema); ``required`` constrains the answer (the grammar of structured output) to a
JSON array of such calls (one at most when ``parallel_tool_calls`` is false); a named function constrains the
answer to that function's arguments object.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from loraplane.http.errors import bad_request
from loraplane.http.protocol import CalledFunction, ChatCompletionRequest, ToolCall
from loraplane.http.structured import Spec, check_schema

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
NO_ARGUMENTS = {"type": "object", "properties": {}}
ANY_OBJECT = {"type": "object", "additionalProperties": True}
_HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


@dataclass(slots=True)
class ToolPlan:
    """What a chat request's tools ask of the prompt, the grammar and the answer."""

    mode: str = "none"  # "none" | "auto" | "required" | "named"
    tools: list[dict] = field(default_factory=list)  # OpenAI tool objects, rendered into the prompt
    names: tuple[str, ...] = ()
    name: str | None = None  # the named function
    spec: Spec | None = None  # the grammar of required / named
    parallel: bool = (
        True  # parallel_tool_calls: an auto answer's calls after the first are dropped when false
    )

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def plan(body: ChatCompletionRequest) -> ToolPlan:
    """The request's ToolPlan; a 400 naming the field for an inconsistent or unenforceable one."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice: needs tools", "tool_choice")
        if body.parallel_tool_calls is not None:
            raise bad_request("parallel_tool_calls: needs tools", "parallel_tool_calls")
        return ToolPlan()
    names = tuple(t.function.name for t in tools)
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    schemas = []
    for i, tool in enumerate(tools):
        params = tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS
        check_schema(params, f"tools[{i}].function.parameters")
        schemas.append(params)
    rendered = [tool.model_dump(exclude_none=True) for tool in tools]
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", [], names, parallel=parallel)
    if choice is None or choice == "auto":
        spec = None
        if any(
            t.function.strict for t in tools
        ):  # strict calls keep to their schema, the others to an object
            calls = [(t.function.name, schema if t.function.strict else ANY_OBJECT)
                     for t, schema in zip(tools, schemas, strict=True)]  # fmt: skip
            spec = Spec("tool_tags", calls, "tools")
        return ToolPlan("auto", rendered, names, spec=spec, parallel=parallel)
    if choice == "required":
        spec = Spec(
            "json_schema", _calls_schema(names, schemas, body.parallel_tool_calls is not False), "tools"
        )
        return ToolPlan("required", rendered, names, spec=spec)
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice.function.name: no tool named {name!r}", "tool_choice.function.name")
    i = names.index(name)
    return ToolPlan(
        "named", rendered, names, name, Spec("json_schema", schemas[i], f"tools[{i}].function.parameters")
    )


def _calls_schema(names: tuple[str, ...], schemas: list[dict], parallel: bool) -> dict:
    """A JSON array of {"name", "arguments"} calls; each tool's own $defs move to the root, renamed."""
    defs: dict = {}
    options = []
    for i, (name, schema) in enumerate(zip(names, schemas, strict=True)):
        schema = _hoist_defs(schema, f"t{i}_", defs)
        options.append({"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                        "required": ["name", "arguments"], "additionalProperties": False})  # fmt: skip
    array = {"type": "array", "items": {"anyOf": options}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    if defs:
        array["$defs"] = defs
    return array


def _hoist_defs(schema: dict, prefix: str, defs: dict) -> dict:
    local = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}  # objects: check_schema
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    text = json.dumps(body)
    for name in local:
        for root in ("#/$defs/", "#/definitions/"):
            text = text.replace(json.dumps(root + name), json.dumps(f"#/$defs/{prefix}{name}"))
    for name, sub in local.items():
        sub_text = json.dumps(sub)
        for other in local:
            for root in ("#/$defs/", "#/definitions/"):
                sub_text = sub_text.replace(json.dumps(root + other), json.dumps(f"#/$defs/{prefix}{other}"))
        defs[f"{prefix}{name}"] = json.loads(sub_text)
    return json.loads(text)


def template_knows_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def conversation(body: ChatCompletionRequest, tool_plan: ToolPlan, native: bool) -> list[dict]:
    """The messages as the chat template takes them (``native``: it renders tools itself)."""
    turns = []
    names = {}  # call id -> function name, for tool messages
    for message in body.messages:
        turn: dict = {"role": message.role, "content": message.text()}
        if message.name:
            turn["name"] = message.name
        if message.tool_calls:
            calls = [
                (c.id, c.function.name, _arguments(c.function.arguments, c.id)) for c in message.tool_calls
            ]
            names.update((cid, name) for cid, name, _ in calls)
            if native:
                turn["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                                      for cid, name, args in calls]  # fmt: skip
            else:
                blocks = [_hermes_call(name, args) for _, name, args in calls]
                turn["content"] = "\n".join(filter(None, [turn["content"], *blocks]))
        if message.role == "tool":
            if native:
                turn["tool_call_id"] = message.tool_call_id
                if message.tool_call_id in names:
                    turn.setdefault("name", names[message.tool_call_id])
            else:
                turn = {"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>"}
        turns.append(turn)
    if tool_plan.tools and not native:
        listing = "\n".join(json.dumps(tool) for tool in tool_plan.tools)
        system = _HERMES_SYSTEM.format(tools=listing)
        if turns and turns[0]["role"] in ("system", "developer"):
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{system}"}
        else:
            turns.insert(0, {"role": "system", "content": system})
    return turns


def _arguments(text: str, call_id: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise bad_request(f"tool_calls: call {call_id!r} has arguments that are not a JSON object",
                          "messages")  # fmt: skip
    return value


def _hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def parse(text: str, tool_plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished answer; no calls: the text as content, unchanged."""
    if tool_plan.mode == "named":
        args = _json(text)
        if isinstance(args, dict):
            return None, [_call(tool_plan.name, args)]
        return text, []
    if tool_plan.mode == "required":
        calls = _json(text)
        if isinstance(calls, list) and calls and all(_is_call(c, tool_plan.names) for c in calls):
            return None, [_call(c["name"], c["arguments"]) for c in calls]
        return text, []
    if tool_plan.mode != "auto":
        return text, []
    calls = [_json(block) for block in TOOL_CALL_RE.findall(text)]
    if calls and all(_is_call(c, tool_plan.names) for c in calls):
        content = TOOL_CALL_RE.sub("", text).strip()
        return content or None, [
            _call(c["name"], _args_of(c)) for c in calls[: None if tool_plan.parallel else 1]
        ]
    bare = _json(text.strip())
    if _is_call(bare, tool_plan.names):
        return None, [_call(bare["name"], _args_of(bare))]
    return text, []


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _args_of(call: dict) -> dict:
    return call["arguments"] if "arguments" in call else call["parameters"]


def _is_call(value, names: tuple[str, ...]) -> bool:
    if not isinstance(value, dict) or value.get("name") not in names:
        return False
    keys = set(value) - {"name"}
    return len(keys) == 1 and keys <= {"arguments", "parameters"} and isinstance(_args_of(value), dict)


def _call(name: str, arguments: dict) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=CalledFunction(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))  # fmt: skip


def streamable_len(text: str) -> int:
    """How many characters of ``text`` (an auto answer so far) may be streamed as content: everything before a
    ``<tool_call>`` tag, or before a tail that could still become one."""
    start = text.find("<tool_call>")
    if start >= 0:
        return start
    tag = "<tool_call>"
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)
