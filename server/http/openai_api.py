"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

A request's way here: resolve ``model`` (the base now, an adapter alias later), refuse what we cannot do
(naming the field), build the prompt's token ids (the chat template for chat), fit max_tokens into
max_model_len, turn the rest into SamplingParams, submit to the AsyncEngine, and answer whole or as SSE.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loraplane.server.engine.sequence import SamplingParams

from .app import ServerState, server_state
from .errors import bad_request, from_engine_value_error
from .protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelList,
    ResponseMessage,
    new_id,
    now,
)
from .streaming import (
    ChatStream,
    CompletionStream,
    TokenTexts,
    chat_logprobs,
    collect,
    completion_logprobs,
    sse,
)

router = APIRouter()

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
COMPLETIONS_DEFAULT_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to all the room left
)


@router.get("/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=server_state(request).models.cards())


# --- request checks -------------------------------------------------------------------------------------------
def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.n != 1:
        raise bad_request(f"n: only n=1 is supported, got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise bad_request(f"{name}: not supported (only 0)", name)
    if body.logit_bias:
        raise bad_request("logit_bias: not supported", "logit_bias")
    if isinstance(body, ChatCompletionRequest):
        if body.tools:
            raise bad_request("tools: tool calling is not supported", "tools")
        if body.tool_choice not in (None, "none"):
            raise bad_request("tool_choice: tool calling is not supported", "tool_choice")
        if body.response_format and body.response_format.get("type") != "text":
            raise bad_request("response_format: only type 'text' is supported", "response_format")
    else:
        if body.echo:
            raise bad_request("echo: not supported", "echo")
        if body.best_of not in (None, 1):
            raise bad_request("best_of: only 1 is supported", "best_of")
        if body.suffix:
            raise bad_request("suffix: not supported", "suffix")


def _fit_max_tokens(
    state: ServerState,
    prompt_len: int,
    requested: int | None,
    param: str,
    default: int | None,
    prompt_param: str,
) -> int:
    """The output budget: ``requested`` if prompt + requested fits max_model_len, else a 400 naming the field."""
    limit = state.max_model_len
    room = limit - prompt_len
    if room <= 0:
        raise bad_request(
            f"{prompt_param}: the prompt is {prompt_len} tokens; this model's maximum context length is {limit} "
            "tokens and leaves no room to generate",
            prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"{param}: this model's maximum context length is {limit} tokens, but you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion)",
            param,
            code="context_length_exceeded",
        )
    return requested


def _sampling(
    body: ChatCompletionRequest | CompletionRequest, max_tokens: int, logprobs: int | None, prompt_param: str
) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise from_engine_value_error(exc, prompt_param) from None


def _submit(
    state: ServerState, prompt: list[int], sampling: SamplingParams, adapter, request_id, prompt_param
):
    try:
        return state.engine.add_request(prompt, sampling, request_id=request_id, adapter=adapter)
    except ValueError as exc:
        raise from_engine_value_error(exc, prompt_param) from None


# --- prompts --------------------------------------------------------------------------------------------------
def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    tokenizer = state.tokenizer
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


def _completion_prompt(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(f"prompt: one prompt per request, got a batch of {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(state.tokenizer.encode(prompt)) if prompt else []
    else:
        ids = list(prompt)
        vocab = state.vocab_size
        bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    if not ids:
        raise bad_request("prompt: must not be empty", "prompt")
    return ids


# --- routes ---------------------------------------------------------------------------------------------------
@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = server_state(request)
    adapter = state.models.resolve(body.model)
    _refuse_unsupported(body)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs: needs logprobs=true", "top_logprobs")
    prompt = _chat_prompt(state, body)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = _fit_max_tokens(state, len(prompt), requested, param, None, "messages")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = _sampling(body, max_tokens, num_logprobs, "messages")
    request_id, created, texts = new_id("chatcmpl"), now(), TokenTexts(state.tokenizer)
    outputs = _submit(state, prompt, sampling, adapter, request_id, "messages")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        render = ChatStream(request_id, body.model, created, include_usage, num_logprobs, texts)
        events = sse(request, state.engine, request_id, outputs, render)
        return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
    result = await collect(request, state.engine, request_id, outputs)
    logprobs = None
    if num_logprobs is not None:
        logprobs = chat_logprobs(result.token_ids, result.logprobs, num_logprobs, texts)
    choice = ChatChoice(
        message=ResponseMessage(content=result.text), logprobs=logprobs, finish_reason=result.finish_reason
    )
    response = ChatCompletion(
        id=request_id, created=created, model=body.model, choices=[choice], usage=result.usage
    )
    return JSONResponse(response.model_dump())


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    state = server_state(request)
    adapter = state.models.resolve(body.model)
    _refuse_unsupported(body)
    prompt = _completion_prompt(state, body.prompt)
    max_tokens = _fit_max_tokens(
        state, len(prompt), body.max_tokens, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt"
    )
    sampling = _sampling(body, max_tokens, body.logprobs, "prompt")
    request_id, created, texts = new_id("cmpl"), now(), TokenTexts(state.tokenizer)
    outputs = _submit(state, prompt, sampling, adapter, request_id, "prompt")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        render = CompletionStream(request_id, body.model, created, include_usage, body.logprobs, texts)
        events = sse(request, state.engine, request_id, outputs, render)
        return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
    result = await collect(request, state.engine, request_id, outputs)
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(result.token_ids, result.logprobs, body.logprobs, texts)
    choice = CompletionChoice(text=result.text, logprobs=logprobs, finish_reason=result.finish_reason)
    response = Completion(
        id=request_id, created=created, model=body.model, choices=[choice], usage=result.usage
    )
    return JSONResponse(response.model_dump())
