"""Request checks beyond the schema: what this engine can do, and limits that depend on the model.

The schema (protocol.py) already bounds every number to a finite value of its type; here each field meets
the served model's own limits (vocabulary size, context length) and the features we do not offer, each
refusal a 400 naming the field. Whatever passes is a SamplingParams the engine can run.
"""

from __future__ import annotations

from loraplane.engine.core.sequence import SamplingParams
from loraplane.http.errors import bad_request, from_engine_value_error
from loraplane.http.protocol import ChatCompletionRequest, CompletionRequest

AnyRequest = ChatCompletionRequest | CompletionRequest

MAX_STOP_STRINGS = 4  # OpenAI's documented bound ("up to 4 sequences")
MAX_STOP_CHARS = 4096  # all stop strings together: each is matched against the output on the engine thread


def refuse_unsupported(body: AnyRequest, vocab_size: int) -> None:
    if body.n != 1:
        raise bad_request(f"n: only n=1 is supported, got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise bad_request(f"{name}: not supported (only 0)", name)
    if body.logit_bias:
        raise bad_request("logit_bias: not supported", "logit_bias")
    check_stop(body.stop)
    if body.top_k is not None and body.top_k > vocab_size:
        raise bad_request(
            f"top_k: must be at most the vocabulary size {vocab_size}, got {body.top_k}", "top_k"
        )
    if isinstance(body, ChatCompletionRequest):
        if body.tools:
            raise bad_request("tools: tool calling is not supported", "tools")
        if body.tool_choice not in (None, "none"):
            raise bad_request("tool_choice: tool calling is not supported", "tool_choice")
        if body.response_format and body.response_format.get("type") != "text":
            raise bad_request("response_format: only type 'text' is supported", "response_format")
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs: needs logprobs=true", "top_logprobs")
    else:
        if body.echo:
            raise bad_request("echo: not supported", "echo")
        if body.best_of not in (None, 1):
            raise bad_request("best_of: only 1 is supported", "best_of")
        if body.suffix:
            raise bad_request("suffix: not supported", "suffix")


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
    body: AnyRequest, max_tokens: int, logprobs: int | None, prompt_param: str
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
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise from_engine_value_error(exc, prompt_param) from None


def chat_prompt(tokenizer, body: ChatCompletionRequest) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages: the served model has no chat template; use /v1/completions", "messages")
    conversation = []
    for message in body.messages:
        turn = {"role": message.role, "content": message.text()}
        if message.name:
            turn["name"] = message.name
        conversation.append(turn)
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2 errors, including the template's own raise_exception()
        raise bad_request(f"messages: the chat template refused them: {exc}", "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))  # the template holds the special tokens


def completion_prompt(tokenizer, vocab_size: int, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(f"prompt: one prompt per request, got a batch of {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if prompt and tokenizer is None:
            raise bad_request("prompt: this server has no tokenizer; send token ids", "prompt")
        ids = list(tokenizer.encode(prompt)) if prompt else []
    else:
        ids = list(prompt)
        bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
        if bad is not None:
            raise bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    if not ids:
        raise bad_request("prompt: must not be empty", "prompt")
    return ids
