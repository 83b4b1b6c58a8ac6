"""Request checks beyond the schema: what this engine can do, and limits that depend on the model.

The schema (protocol.py) already bounds every number to a finite value of its type; here each field meets
the served model's own limits (vocabulary size, context length) and the features we do not offer, each
refusal a 400 naming the field. Whatever passes is a SamplingParams the engine can run.
"""

from __future__ import annotations

from loraplane.engine.core.sequence import SamplingParams
from loraplane.http import tools
from loraplane.http.errors import bad_request, from_engine_value_error
from loraplane.http.protocol import ChatCompletionRequest, CompletionRequest
from loraplane.http.tools import ToolPlan, template_knows_tools

AnyRequest = ChatCompletionRequest | CompletionRequest

MAX_STOP_STRINGS = 4  # OpenAI's documented bound ("up to 4 sequences")
MAX_STOP_CHARS = 4096  # all stop strings together: each is matched against the output on the engine thread


# Fields declared so that they are refused by name: the values that ask for nothing (besides null, always fine).
# A value outside its tuple is a 400 naming the field; a field not listed here is honoured.
_OFF: dict[str, tuple] = {
    "best_of": (1,),  # vLLM deprecated it; n samples are independent anyway
    "use_beam_search": (False,),
    "length_penalty": (1,),  # beam search only
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "guided_grammar": (),
    "guided_decoding_backend": ("xgrammar", "auto"),  # the one grammar library this server has
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "structured_outputs": (),
    "priority": (0,),
    "request_id": (),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
}
_CHAT_OFF: dict[str, tuple] = {
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "moderation": (),
    "prediction": (),
    "prompt_cache_options": (),
    "prompt_cache_retention": (),
    "reasoning_effort": (),
    "service_tier": ("auto", "default"),
    "store": (False,),  # nothing is kept after the answer
    "verbosity": (),
    "web_search_options": (),
    "echo": (False,),
    "documents": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "mm_processor_kwargs": ({},),
}
_MESSAGE_OFF: dict[str, tuple] = {
    "function_call": (),
    "refusal": (),
    "audio": (),
    "annotations": ([],),
}
_COMPLETION_OFF: dict[str, tuple] = {"suffix": ("",), "prompt_embeds": ()}


def _same(value, ok) -> bool:
    if isinstance(value, bool) or isinstance(ok, bool):  # true is not 1 here
        return value is ok
    return value == ok


def _refuse_set(obj, table: dict[str, tuple], prefix: str = "") -> None:
    for name, off in table.items():
        value = getattr(obj, name)
        if value is not None and not any(_same(value, ok) for ok in off):
            param = f"{prefix}{name}"
            raise bad_request(f"{param}: not supported by this server (got {value!r})", param)


def refuse_unsupported(body: AnyRequest, vocab_size: int) -> None:
    _refuse_set(body, _OFF)
    if body.stream_options is not None:
        if not body.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        _refuse_set(body.stream_options, {"include_obfuscation": (False,)}, "stream_options.")
    check_stop(body.stop)
    if body.top_k is not None and body.top_k > vocab_size:
        raise bad_request(
            f"top_k: must be at most the vocabulary size {vocab_size}, got {body.top_k}", "top_k"
        )
    _check_logit_bias(body.logit_bias or {}, vocab_size)
    bad_stop = next((t for t in body.stop_token_ids or () if t >= vocab_size), None)
    if bad_stop is not None:
        raise bad_request(
            f"stop_token_ids: token id {bad_stop} is outside the vocabulary [0, {vocab_size})",
            "stop_token_ids",
        )
    if isinstance(body, ChatCompletionRequest):
        _refuse_set(body, _CHAT_OFF)
        for i, message in enumerate(body.messages):
            _refuse_set(message, _MESSAGE_OFF, f"messages[{i}].")
            _check_tool_fields(message, f"messages[{i}].")
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs: needs logprobs=true", "top_logprobs")
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request(
                "continue_final_message: needs add_generation_prompt=false", "continue_final_message"
            )
    else:
        _refuse_set(body, _COMPLETION_OFF)
        if body.echo and body.logprobs is not None:  # it would need the prompt's own logprobs
            raise bad_request("echo: not supported together with logprobs", "echo")


def _check_tool_fields(message, prefix: str) -> None:
    if message.tool_calls and message.role != "assistant":
        raise bad_request(
            f"{prefix}tool_calls: only an assistant message carries tool calls", f"{prefix}tool_calls"
        )
    if (message.role == "tool") != (message.tool_call_id is not None):
        raise bad_request(f"{prefix}tool_call_id: a tool message needs one, other messages none",
                          f"{prefix}tool_call_id")  # fmt: skip


def _check_logit_bias(bias: dict[str, float], vocab_size: int) -> None:
    for key in bias:
        if not key.isdigit() or int(key) >= vocab_size:
            raise bad_request(
                f"logit_bias: keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias"
            )


def check_stop(stop: str | list[str] | None) -> None:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    chars = sum(len(s) for s in stops)
    if chars > MAX_STOP_CHARS:
        raise bad_request(f"stop: at most {MAX_STOP_CHARS} characters in all, got {chars}", "stop")


def fit_max_tokens(
    max_model_len: int,
    prompt_len: int,
    requested: int | None,
    param: str,
    default: int | None,
    prompt_param: str,
) -> int:
    """The output budget: ``requested`` if prompt + requested fits max_model_len, else a 400 naming the field."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(
            f"{prompt_param}: the prompt is {prompt_len} tokens; this model's maximum context length is "
            f"{max_model_len} tokens and leaves no room to generate",
            prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"{param}: this model's maximum context length is {max_model_len} tokens, but you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion)",
            param,
            code="context_length_exceeded",
        )
    return requested


def sampling_params(
    body: AnyRequest, max_tokens: int, logprobs: int | None, prompt_param: str, grammar=None
) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),  # -1 (vLLM's "off") and 0 both disable it
            seed=body.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            logit_bias=tuple((int(k), v) for k, v in (body.logit_bias or {}).items()),
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_p=body.min_p or 0.0,
            grammar=grammar,
        )
    except ValueError as exc:
        raise from_engine_value_error(exc, prompt_param) from None


def chat_prompt(tokenizer, body: ChatCompletionRequest, tool_plan: ToolPlan) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages: the served model has no chat template; use /v1/completions", "messages")
    native = template_knows_tools(tokenizer)
    conversation = tools.conversation(body, tool_plan, native)
    if body.continue_final_message and conversation[-1]["role"] != "assistant":
        raise bad_request(
            "continue_final_message: the last message must be the assistant's", "continue_final_message"
        )
    extra = {"tools": tool_plan.tools} if native and tool_plan.tools else {}
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **extra,
        )
    except Exception as exc:  # jinja2 errors, including the template's own raise_exception()
        raise bad_request(f"messages: the chat template refused them: {exc}", "messages") from None
    # The template holds the special tokens; add_special_tokens (vLLM) adds the tokenizer's own on top.
    return list(tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))


def prompt_text(tokenizer, prompt) -> str:
    """The prompt as text, for echo: as sent, or its token ids decoded."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt) if tokenizer is not None else ""


def completion_prompt(tokenizer, vocab_size: int, prompt, add_special_tokens: bool = True) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(f"prompt: one prompt per request, got a batch of {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if prompt and tokenizer is None:
            raise bad_request("prompt: this server has no tokenizer; send token ids", "prompt")
        ids = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens)) if prompt else []
    else:
        ids = list(prompt)
        bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
        if bad is not None:
            raise bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    if not ids:
        raise bad_request("prompt: must not be empty", "prompt")
    return ids
