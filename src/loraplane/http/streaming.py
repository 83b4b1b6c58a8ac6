"""From engine outputs to OpenAI bodies: collect one result, or render SSE chunks; abort on client disconnect.

The engine yields one RequestOutput per token (text is the delta, already cut at stop strings). A watcher
task waits for the client's ``http.disconnect`` and aborts the request in the engine, so a client that
leaves, streaming or not, frees its KV blocks at once instead of when its generation would have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from loraplane.engine.api import OverloadedError
from loraplane.engine.core.async_engine import AsyncEngine
from loraplane.engine.core.errors import EngineDeadError
from loraplane.http.choices import Choices
from loraplane.http.errors import SERVER_ERROR, APIError, engine_stopped, too_many_requests
from loraplane.http.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from loraplane.http.runs import RequestFailed

if TYPE_CHECKING:  # the HTTP side imports only the engine's public modules at run time
    from loraplane.engine.core.llm_engine import RequestOutput

log = logging.getLogger("loraplane.http")


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, engine: AsyncEngine, request_ids: list[str]):
    """``request_ids``: the engine requests started so far (the list grows as a request's choices start)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("client left; aborting %s", ", ".join(request_ids))
        for request_id in list(request_ids):
            engine.abort(request_id)

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


def usage_of(out: RequestOutput) -> Usage:
    total = out.num_prompt_tokens + out.num_output_tokens
    return Usage(
        prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens, total_tokens=total
    )


def shown_tokens(out: RequestOutput) -> tuple[list[int], list[dict[int, float]]]:
    """The output's new token ids and logprobs, without a stop token that ended it (end of sequence or
    stop_token_ids): its text is not in the answer, so logprobs do not list it either (as OpenAI and vLLM)."""
    ids, logprobs = out.new_token_ids, out.logprobs or []
    if out.finished and isinstance(out.stop_reason, int) and ids and ids[-1] == out.stop_reason:
        return ids[:-1], logprobs[: len(ids) - 1]
    return ids, logprobs


@dataclass(slots=True)
class Generation:
    """One finished request, collected."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # without a final stop token
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None

    def add(self, out: RequestOutput) -> None:
        ids, logprobs = shown_tokens(out)
        self.text += out.text
        self.token_ids += ids
        self.logprobs += logprobs
        self.finish_reason = out.finish_reason
        self.stop_reason = out.stop_reason
        self.usage = usage_of(out)


class Usages:
    """The usage of a request's choices so far: its prompt once, their completions summed (as OpenAI)."""

    def __init__(self) -> None:
        self.prompt = 0
        self.completions: dict[int, int] = {}

    def add(self, index: int, out: RequestOutput) -> None:
        self.prompt = out.num_prompt_tokens
        self.completions[index] = out.num_output_tokens

    def usage(self) -> Usage:
        completion = sum(self.completions.values())
        return Usage(
            prompt_tokens=self.prompt, completion_tokens=completion, total_tokens=self.prompt + completion
        )


async def collect(request: Request, engine: AsyncEngine, choices: Choices) -> tuple[list[Generation], Usage]:
    results = [Generation() for _ in range(choices.n)]
    usages = Usages()
    try:
        async with abort_on_disconnect(request, engine, choices.started):
            async for index, out in choices:
                results[index].add(out)
                usages.add(index, out)
    except asyncio.CancelledError:
        choices.meter.end_route("aborted")
        raise
    except BaseException:
        choices.meter.end_route("error")
        raise
    choices.meter.end_route("ok")  # the usage line is written before the answer is sent
    return results, usages.usage()


async def sse(
    request: Request, engine: AsyncEngine, request_id: str, choices: Choices, render
) -> AsyncIterator[str]:
    """``data: {json}\n\n`` per chunk, ``data: [DONE]\n\n`` last; ``render`` is a renderers.Streams."""
    meter = choices.meter
    async with abort_on_disconnect(request, engine, choices.started):
        try:
            for chunk in render.open():
                yield f"data: {chunk}\n\n"
            async for index, out in choices:
                for chunk in render(index, out):
                    yield f"data: {chunk}\n\n"
            meter.end_route("ok")  # the usage line is written before the last chunks
            for chunk in render.close():
                yield f"data: {chunk}\n\n"
        except Exception as exc:  # the status line is long gone: report in-band, as OpenAI does
            meter.end_route("error")
            yield f"data: {json.dumps(in_band_error(request_id, exc).body().model_dump())}\n\n"
        finally:
            meter.end_route("aborted")  # the client left mid-stream (a no-op once the route ended)
    yield "data: [DONE]\n\n"


def in_band_error(request_id: str, exc: Exception) -> APIError:
    """What a stream that already answered 200 says when its request fails midway."""
    if isinstance(exc, EngineDeadError):
        log.error("engine died during %s: %s", request_id, exc)
        return engine_stopped()
    if isinstance(exc, OverloadedError):
        return too_many_requests(f"the server is overloaded: {exc}", exc.retry_after_s, "overloaded")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), code="invalid_request")
    if isinstance(exc, RequestFailed):
        log.error("request %s failed: %s", request_id, exc)
        return APIError(500, f"the request failed: {exc}", type=SERVER_ERROR, code="request_failed")
    log.exception("request %s failed", request_id)
    return APIError(500, "internal server error", type=SERVER_ERROR)


# --- logprobs -----------------------------------------------------------------------------------------------
class TokenTexts:
    """Token id -> its own text and UTF-8 bytes, as logprobs show it (memoized: it runs for every token)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The entry holds the sampled token plus the top k; a sampled token outside the top k sorts last.
    return sorted(entry.items(), key=lambda item: item[1], reverse=True)[:k]


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, float]], k: int, texts: TokenTexts
) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = texts(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        sampled = top(token_id, entry[token_id])
        content.append(
            TokenLogprob(**sampled.model_dump(), top_logprobs=[top(t, lp) for t, lp in _top(entry, k)])
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, float]], k: int, texts: TokenTexts, offset: int = 0
) -> CompletionLogprobs:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = texts(token_id)
        tokens.append(text)
        token_logprobs.append(entry[token_id])
        top: dict[str, float] = {}
        for t, lp in _top(entry, k):
            top.setdefault(texts(t), lp)  # two tokens may share a text (partial UTF-8): keep the likelier
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )
