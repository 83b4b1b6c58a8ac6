"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

A request's way here: resolve ``model`` for this caller (the base, or an adapter alias fixed to its serving
version now), refuse what we cannot do (naming the field), build the prompt's token ids (the chat template
for chat), fit max_tokens into max_model_len, admit it under the key's limits, submit it to the AsyncEngine,
and answer whole or as SSE.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from loraplane.engine.api import AdapterError, OverloadedError
from loraplane.http import structured, tools
from loraplane.http.auth import Principal
from loraplane.http.canary import ROUTE_KEY_HEADER, route_key
from loraplane.http.checks import (
    chat_prompt,
    completion_prompt,
    fit_max_tokens,
    prompt_text,
    refuse_unsupported,
    sampling_params,
)
from loraplane.http.choices import Choices, HeldTicket, child_sampling
from loraplane.http.errors import (
    SERVER_ERROR,
    APIError,
    bad_request,
    from_engine_value_error,
    too_many_requests,
)
from loraplane.http.limits import LimitExceeded
from loraplane.http.models import Target, model_not_found
from loraplane.http.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    ResponseMessage,
    StreamOptions,
    new_id,
    now,
)
from loraplane.http.renderers import ChatStream, CompletionStream, Head, Streams
from loraplane.http.runs import RequestFailed, Run
from loraplane.http.state import ServerState, require_api_key, server_state
from loraplane.http.streaming import TokenTexts, Usages, chat_logprobs, collect, completion_logprobs, sse

router = APIRouter()

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
VERSION_HEADER = "X-Loraplane-Adapter-Version"  # the adapter version that answered (fixed at arrival)
COMPLETIONS_DEFAULT_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to all the room left
)


@router.get("/models")
async def list_models(request: Request, principal: Principal = Depends(require_api_key)) -> ModelList:
    state = server_state(request)
    return ModelList(data=state.models.cards(state.engine, principal))


@router.get("/models/{model_id:path}")
async def retrieve_model(
    model_id: str, request: Request, principal: Principal = Depends(require_api_key)
) -> ModelCard:
    """One model as /v1/models lists it; ``name@version`` too while it is loaded. Others: 404."""
    state = server_state(request)
    card = next((c for c in state.models.cards(state.engine, principal) if c.id == model_id), None)
    if card is None:
        target = state.models.resolve(state.engine, model_id, principal)  # 404 (or 403 for the base)
        base = state.models.base_name
        card = ModelCard(id=model_id, created=state.models.created, root=base, parent=base,
                         version=target.version)  # fmt: skip
    return card


def _served_by(target: Target, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Response headers: ``extra``, plus the version an adapter request runs on, so that a client can tell
    which version of an alias answered across a switch (absent for the base)."""
    headers = dict(extra or {})
    if target.version is not None:
        headers[VERSION_HEADER] = target.version
    return headers


def _target(
    request: Request, state: ServerState, model: str, principal: Principal, user: str | None
) -> Target:
    target = state.models.resolve(state.engine, model, principal)
    if "@" not in model:  # the alias: a canary split may send this request's route key to the canary
        key_name = principal.name if principal.key_index >= 0 else None
        target = state.splits.route(state.engine, target, route_key(request.headers.get(ROUTE_KEY_HEADER), user,
                                                                    key_name))  # fmt: skip
    request.state.model = model
    request.state.adapter_label = state.metrics.adapter_label(target.adapter)
    return target


def _admit(state: ServerState, principal: Principal, prompt: list[int], max_tokens: int):
    """Count the request in under the key's limits (once, whatever n; it reserves every choice's max_tokens)
    or answer 429."""
    try:
        return state.limits.admit(principal, len(prompt), max_tokens)
    except LimitExceeded as exc:
        state.metrics.rejected.labels("key_limit").inc()
        raise too_many_requests(exc.message, exc.retry_after_s, "rate_limit_exceeded") from None


def _choices(request: Request, state: ServerState, principal: Principal, target: Target, prompt: list[int],
             sampling, n: int, request_id: str, prompt_param: str) -> Choices:  # fmt: skip
    """Admit, then submit choice 0 (refusals come back as HTTP errors); Choices starts the others later."""
    ticket = _admit(state, principal, prompt, sampling.max_tokens * n)
    held = HeldTicket(ticket) if n > 1 else ticket  # n > 1: Choices gives the key's slot back at the end
    meter = state.usage.start(request_id, principal.name, target.adapter, target.version, len(prompt))

    def start(index: int, child_id: str):
        tier = "gpu"
        if target.key is not None:
            tier = state.engine.tier_of(target.key) or "remote"
            if tier != "gpu":
                state.metrics.cold_starts.labels(tier).inc()
        run = Run(child_id, target, tier, held, state.metrics, meter, index)
        stream = state.engine.add_request(prompt, child_sampling(sampling, index), request_id=child_id,
                                          adapter=target.key, lease=lease)  # fmt: skip
        return state.splits.watch(target, run.outputs(stream))

    lease = choices = None
    try:
        # n > 1: the later choices start on the version the first one got, even if its unload began meanwhile
        lease = state.engine.lease_adapter(target.key) if n > 1 and target.key is not None else None
        choices = Choices(request_id, n, start, ticket if n > 1 else None, meter, lease)
    except AdapterError as exc:  # unloaded between resolve and submit: as if it never existed
        ticket.release()
        if exc.reason == "AdapterNotFound":
            raise model_not_found(request.state.model) from None
        raise APIError(503, f"model `{request.state.model}` is not usable now: {exc.message}",
                       type=SERVER_ERROR, code=exc.reason) from None  # fmt: skip
    except OverloadedError:
        ticket.release()
        state.metrics.rejected.labels("overload").inc()
        raise
    except ValueError as exc:
        ticket.release()
        raise from_engine_value_error(exc, prompt_param) from None
    except BaseException:
        ticket.release()
        raise
    state.metrics.prompt_tokens.labels(request.state.adapter_label).inc(len(prompt))
    return choices


async def _collect(request: Request, state: ServerState, choices: Choices, prompt_param: str):
    try:
        return await collect(request, state.engine, choices)
    except RequestFailed as exc:
        raise APIError(500, f"the request failed: {exc}", type=SERVER_ERROR, code="request_failed") from None
    except ValueError as exc:
        raise from_engine_value_error(exc, prompt_param) from None


async def _grammar(state: ServerState, body, spec: structured.Spec | None):
    """The engine grammar of ``spec`` (compiled off the event loop), or None."""
    if spec is None:
        return None
    if body.min_tokens:
        raise bad_request(f"min_tokens: cannot be combined with {spec.param} (the grammar decides where the "
                          "output ends)", "min_tokens")  # fmt: skip
    return await run_in_threadpool(state.grammars.compile, spec, state.tokenizer, state.vocab_size)


def _chat_spec(body: ChatCompletionRequest, tool_plan: tools.ToolPlan) -> structured.Spec | None:
    spec = structured.requested(body)
    if spec is not None and tool_plan.spec is not None:
        raise bad_request(f"{spec.param}: cannot be combined with tool_choice {tool_plan.mode}", spec.param)
    return spec or tool_plan.spec


def _sse(
    request: Request, state: ServerState, target: Target, request_id: str, choices: Choices, render: Streams
):
    events = sse(request, state.engine, request_id, choices, render)
    return StreamingResponse(events, media_type="text/event-stream", headers=_served_by(target, _SSE_HEADERS))


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, principal: Principal = Depends(require_api_key)
):
    state = server_state(request)
    target = _target(request, state, body.model, principal, body.user)
    refuse_unsupported(body, state.vocab_size)
    tool_plan = tools.plan(body)
    spec = _chat_spec(body, tool_plan)
    prompt = chat_prompt(state.tokenizer, body, tool_plan)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = fit_max_tokens(state.max_model_len, len(prompt), requested, param, None, "messages")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await _grammar(state, body, spec)
    sampling = sampling_params(body, max_tokens, num_logprobs, "messages", grammar)
    request_id, created, texts = new_id("chatcmpl"), now(), TokenTexts(state.tokenizer)
    choices = _choices(request, state, principal, target, prompt, sampling, body.n, request_id, "messages")
    if body.stream:
        options = body.stream_options or StreamOptions()
        head = Head(request_id, body.model, created, Usages(), options.continuous_usage_stats)
        render = Streams(head, body.n, options.include_usage,
                         lambda i: ChatStream(head, i, num_logprobs, texts, tool_plan))  # fmt: skip
        return _sse(request, state, target, request_id, choices, render)
    results, usage = await _collect(request, state, choices, "messages")
    answers = []
    for index, result in enumerate(results):
        logprobs = None
        if num_logprobs is not None:
            logprobs = chat_logprobs(result.token_ids, result.logprobs, num_logprobs, texts)
        content, calls = tools.parse(result.text, tool_plan)
        message = ResponseMessage(content=content, tool_calls=calls or None)
        answers.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                  finish_reason="tool_calls" if calls else result.finish_reason,
                                  stop_reason=result.stop_reason))  # fmt: skip
    response = ChatCompletion(id=request_id, created=created, model=body.model, choices=answers, usage=usage)
    return JSONResponse(response.model_dump(), headers=_served_by(target))


@router.post("/completions")
async def completions(
    body: CompletionRequest, request: Request, principal: Principal = Depends(require_api_key)
):
    state = server_state(request)
    target = _target(request, state, body.model, principal, body.user)
    refuse_unsupported(body, state.vocab_size)
    add_special = body.add_special_tokens is not False
    prompt = completion_prompt(state.tokenizer, state.vocab_size, body.prompt, add_special)
    max_tokens = fit_max_tokens(
        state.max_model_len,
        len(prompt),
        body.max_tokens,
        "max_tokens",
        COMPLETIONS_DEFAULT_MAX_TOKENS,
        "prompt",
    )
    grammar = await _grammar(state, body, structured.requested(body))
    sampling = sampling_params(body, max_tokens, body.logprobs, "prompt", grammar)
    echo = prompt_text(state.tokenizer, body.prompt) if body.echo else ""
    request_id, created, texts = new_id("cmpl"), now(), TokenTexts(state.tokenizer)
    choices = _choices(request, state, principal, target, prompt, sampling, body.n, request_id, "prompt")
    if body.stream:
        options = body.stream_options or StreamOptions()
        head = Head(request_id, body.model, created, Usages(), options.continuous_usage_stats)
        render = Streams(head, body.n, options.include_usage,
                         lambda i: CompletionStream(head, i, body.logprobs, texts, echo))  # fmt: skip
        return _sse(request, state, target, request_id, choices, render)
    results, usage = await _collect(request, state, choices, "prompt")
    answers = []
    for index, result in enumerate(results):
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(result.token_ids, result.logprobs, body.logprobs, texts)
        answers.append(CompletionChoice(index=index, text=echo + result.text, logprobs=logprobs,
                                        finish_reason=result.finish_reason, stop_reason=result.stop_reason))  # fmt: skip
    response = Completion(id=request_id, created=created, model=body.model, choices=answers, usage=usage)
    return JSONResponse(response.model_dump(), headers=_served_by(target))
