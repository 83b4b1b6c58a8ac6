"""Structured output: ``response_format`` (``json_object``, ``json_schema``) and vLLM's ``guided_json``,
``guided_regex`` and ``guided_choice``, compiled by xgrammar into a grammar the engine applies to the request's
rows only (engine.api.Grammar).

xgrammar is the ``structured`` extra: imported on the first request that asks for structured output, never by
the engine. JSON comes in one layout (``{"a": 1, "b": [2, 3]}``: no whitespace but after ``,`` and ``:``), and
an object schema allows only the properties it lists (as OpenAI's strict mode), so an answer always validates.
A schema keyword the grammar would not enforce is refused with a 400 naming it, never ignored.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from loraplane.http.errors import bad_request

INSTALL_HINT = "pip install 'loraplane[structured]'"

# Keywords xgrammar enforces (checked one by one against invalid instances), and annotations that constrain
# nothing. Anything else is refused: xgrammar would accept the schema and not enforce the keyword.
_ENFORCED = frozenset(
    "type properties required additionalProperties items prefixItems minItems maxItems enum const anyOf oneOf "
    "$ref $defs definitions pattern minLength maxLength minimum maximum exclusiveMinimum exclusiveMaximum "
    "multipleOf format maxProperties patternProperties propertyNames unevaluatedProperties contains allOf".split()
)
_ANNOTATIONS = frozenset(
    "title description default examples $schema $id $comment deprecated readOnly writeOnly".split()
)
_FORMATS = frozenset(
    "email date time date-time duration ipv4 ipv6 hostname uuid uri uri-reference uri-template json-pointer "
    "relative-json-pointer".split()
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # {name: schema}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema]
_SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames", "contains")
_MAX_SCHEMA_NODES = 10_000  # a bound on the walk (and on the compile behind it)


@dataclass(frozen=True, slots=True)
class Spec:
    """What one request asks its output to be."""

    kind: str  # "json_schema" | "json_object" | "regex" | "choice" | "tool_tags"
    value: (
        Any  # the schema (dict), the regex (str), the choices (list of str), [(function, schema)] (tool_tags)
    )
    param: str  # the request field it came from: every error about it names this


def requested(body) -> Spec | None:
    """The structured output ``body`` asks for, or None; a 400 naming the field for a malformed one."""
    asked = [
        name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(body, name) is not None
    ]
    fmt = body.response_format
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise bad_request(f"{asked[1]}: only one of {', '.join(asked)} may be set", asked[1])
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        return _response_format(fmt)
    if name == "guided_json":
        return _json_spec(body.guided_json, "guided_json")
    if name == "guided_regex":
        if not isinstance(body.guided_regex, str) or not body.guided_regex:
            raise bad_request("guided_regex: must be a non-empty string (a regular expression)", name)
        return Spec("regex", body.guided_regex, name)
    choices = body.guided_choice
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request("guided_choice: must be a non-empty list of non-empty strings", name)
    return Spec("choice", choices, name)


def _response_format(fmt: Any) -> Spec:
    param = "response_format"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request(f"{param}: must be an object with a type (text, json_object, json_schema)", param)
    kind = fmt["type"]
    if kind not in ("json_object", "json_schema"):
        raise bad_request(
            f"{param}.type: must be text, json_object or json_schema, got {kind!r}", f"{param}.type"
        )
    extra = sorted(set(fmt) - {"type", "json_schema"} - ({"json_schema"} if kind == "json_schema" else set()))
    if kind == "json_object" and "json_schema" in fmt:
        extra.append("json_schema")
    if extra:
        raise bad_request(f"{param}.{extra[0]}: unknown field for type {kind}", f"{param}.{extra[0]}")
    if kind == "json_object":
        return Spec("json_object", {"type": "object"}, param)
    spec = fmt.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{param}: required for type json_schema (an object with name and schema)", param)
    unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if unknown:
        raise bad_request(f"{param}.{unknown[0]}: unknown field", f"{param}.{unknown[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise bad_request(f"{param}.name: required, 1-64 of a-z, A-Z, 0-9, _ and -", f"{param}.name")
    if spec.get("strict") not in (None, True, False):
        raise bad_request(f"{param}.strict: must be a boolean", f"{param}.strict")
    if "schema" not in spec:
        raise bad_request(f"{param}.schema: required", f"{param}.schema")
    return _json_spec(spec["schema"], f"{param}.schema")


def _json_spec(schema: Any, param: str) -> Spec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{param}: not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: must be a JSON Schema object", param)
    check_schema(schema, param)
    return Spec("json_schema", schema, param)


def check_schema(schema: dict, param: str) -> None:
    """A 400 naming the first keyword (as ``param.path.keyword``) that the grammar would not enforce."""
    pending: list[tuple[Any, str]] = [(schema, param)]
    seen = 0
    while pending:
        node, path = pending.pop()
        seen += 1
        if seen > _MAX_SCHEMA_NODES:
            raise bad_request(f"{param}: more than {_MAX_SCHEMA_NODES} subschemas", param)
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise bad_request(f"{path}: a schema must be an object or a boolean", path)
        for key, value in node.items():
            where = f"{path}.{key}"
            if key in _ANNOTATIONS:
                continue
            if key not in _ENFORCED:
                raise bad_request(f"{where}: JSON Schema keyword not supported for structured output", where)
            if key == "format" and (not isinstance(value, str) or value not in _FORMATS):
                raise bad_request(
                    f"{where}: format {value!r} not supported (supported: {', '.join(sorted(_FORMATS))})",
                    where,
                )
            if key == "allOf" and not (isinstance(value, list) and len(value) == 1):
                raise bad_request(f"{where}: only an allOf of one schema is supported", where)
            if key in _SCHEMA_MAPS:
                if not isinstance(value, dict):
                    raise bad_request(f"{where}: must be an object of schemas", where)
                pending.extend((sub, f"{where}.{name}") for name, sub in value.items())
            elif key in _SCHEMA_LISTS:
                if not isinstance(value, list):
                    raise bad_request(f"{where}: must be a list of schemas", where)
                pending.extend((sub, f"{where}[{i}]") for i, sub in enumerate(value))
            elif key in _SCHEMA_ONE:
                if key == "items" and isinstance(value, list):
                    raise bad_request(f"{where}: use prefixItems for a list of item schemas", where)
                pending.append((value, where))


class Grammars:
    """The server's grammar compiler: built on first use from the tokenizer (about a second for a 50k vocabulary),
    then shared; xgrammar caches compiled grammars by their source."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compiler = None
        self._xgr = None
        self._printable = None  # int32 [ceil(V / 32)]: tokens without a control byte (compact JSON's tokens)

    def _ready(self, tokenizer, vocab_size: int, param: str):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                except ImportError:
                    raise bad_request(
                        f"{param}: structured output needs the xgrammar package on the server ({INSTALL_HINT})",
                        param,
                    ) from None
                if tokenizer is None:
                    raise bad_request(f"{param}: structured output needs a server with a tokenizer", param)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
                self._printable = _printable_mask(info.decoded_vocab, vocab_size)
                self._xgr, self._compiler = xgrammar, xgrammar.GrammarCompiler(info)
            return self._xgr, self._compiler

    def compile(self, spec: Spec, tokenizer, vocab_size: int) -> CompiledGrammar:
        """The engine's grammar for ``spec`` (blocking: call it off the event loop); a 400 naming spec.param
        when the compiler refuses it."""
        xgr, compiler = self._ready(tokenizer, vocab_size, spec.param)
        try:
            if spec.kind == "json_object":
                compiled = compiler.compile_json_schema(json.dumps(spec.value), any_whitespace=False,
                                                        strict_mode=False)  # fmt: skip
            elif spec.kind == "json_schema":
                compiled = compiler.compile_json_schema(json.dumps(spec.value), any_whitespace=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "tool_tags":
                compiled = compiler.compile_structural_tag(tool_call_tags(spec.value))
            else:  # EBNF string literals take JSON's escapes
                compiled = compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in spec.value)
                )
        except Exception as exc:  # noqa: BLE001 - the compiler's input is the request's alone: its error is a 400
            raise bad_request(f"{spec.param}: {_compiler_message(exc)}", spec.param) from None
        return CompiledGrammar(xgr, compiled, self._printable if spec.kind.startswith("json") else None)


def tool_call_tags(functions: list[tuple[str, dict]]) -> dict:
    """xgrammar's structural tag for Hermes tool calls: free text; after ``<tool_call>``, one of ``functions``
    with arguments of its schema, then ``</tool_call>``, and free text again."""
    tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": schema}, "end": "}\n</tool_call>"}
            for name, schema in functions]  # fmt: skip
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags},
    }


def _compiler_message(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[03:42:41] /project/cpp/x.cc:94: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)


def _printable_mask(decoded_vocab: list[bytes], vocab_size: int):
    """The tokens that hold no byte below 0x20, as a bitmask row. JSON forbids raw control characters in
    strings, and compact JSON has no whitespace besides spaces, yet xgrammar's string rule lets most control
    bytes through: JSON grammars take this mask on top."""
    import torch

    ok = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.int64)  # ids past the tokenizer's stay banned
    tokens = decoded_vocab[:vocab_size]
    ok[: len(tokens)] = torch.tensor([not any(b < 0x20 for b in token) for token in tokens])
    words = (ok.view(-1, 32) << torch.arange(32)).sum(dim=1)  # [W] in [0, 2^32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class CompiledGrammar:
    """engine.api.Grammar over one xgrammar CompiledGrammar; each sequence gets a GrammarMatcher."""

    def __init__(self, xgr, compiled, printable=None) -> None:
        self._xgr, self.compiled, self.printable = xgr, compiled, printable

    def matcher(self, stop_token_ids: tuple[int, ...]):
        if not stop_token_ids:  # ignore_eos: the grammar ends the output itself once complete
            matcher = self._xgr.GrammarMatcher(self.compiled, terminate_without_stop_token=True)
        else:
            matcher = self._xgr.GrammarMatcher(self.compiled, override_stop_tokens=list(stop_token_ids))
        return matcher if self.printable is None else PrintableMatcher(matcher, self.printable)


class PrintableMatcher:
    """An xgrammar matcher whose rows also drop the tokens with control bytes (see _printable_mask)."""

    def __init__(self, matcher, printable) -> None:
        self.matcher, self.printable = matcher, printable

    def fill_next_token_bitmask(self, bitmask, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)
        bitmask[index] &= self.printable

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
