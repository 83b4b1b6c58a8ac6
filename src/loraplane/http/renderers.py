"""SSE chunks of a streamed answer: one renderer per choice, and ``Streams`` over the n choices of a request.

Each choice streams as its own ``index``: chat opens it with the role, then content deltas, then an empty delta
with the finish reason; completions send text deltas (after the prompt, with echo). With
``stream_options.include_usage`` one last chunk carries the request's usage (no choices); vLLM's
``continuous_usage_stats`` puts the usage so far on every chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplane.http.protocol import ChatChunkChoice, ChatCompletionChunk, Completion, CompletionChoice, Usage
from loraplane.http.streaming import TokenTexts, Usages, chat_logprobs, completion_logprobs, shown_tokens
from loraplane.http.tools import ToolPlan, parse, streamable_len

if TYPE_CHECKING:  # the HTTP side imports only the engine's public modules at run time
    from loraplane.engine.core.llm_engine import RequestOutput


@dataclass(slots=True)
class Head:
    """What every chunk of one answer repeats."""

    id: str
    model: str
    created: int
    usages: Usages
    continuous_usage: bool = False

    def usage(self, final: bool = False) -> Usage | None:
        return self.usages.usage() if final or self.continuous_usage else None


@dataclass(slots=True)
class ChatStream:
    head: Head
    index: int
    num_logprobs: int | None  # None: no logprobs
    texts: TokenTexts
    tool_plan: ToolPlan = field(default_factory=ToolPlan)
    answer: str = ""  # with tools: the text so far (calls are parsed from it at the end)
    sent: int = 0  # with tools: characters of ``answer`` streamed as content

    def chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        h = self.head
        return ChatCompletionChunk(
            id=h.id, created=h.created, model=h.model, choices=choices, usage=usage or h.usage()
        ).model_dump_json()

    def open(self) -> list[str]:
        return [self.chunk([ChatChunkChoice(index=self.index, delta={"role": "assistant", "content": ""})])]

    def __call__(self, out: RequestOutput) -> list[str]:
        chunks = []
        logprobs = None
        ids, entries = shown_tokens(out)
        if self.num_logprobs is not None and entries:
            logprobs = chat_logprobs(ids, entries, self.num_logprobs, self.texts)
        content = self._content(out.text) if self.tool_plan.parses else out.text
        if content or logprobs is not None:
            delta = ChatChunkChoice(index=self.index, delta={"content": content}, logprobs=logprobs)
            chunks.append(self.chunk([delta]))
        if out.finished:
            reason = out.finish_reason
            if self.tool_plan.parses:
                delta = self._tool_delta()
                if delta:
                    chunks.append(self.chunk([ChatChunkChoice(index=self.index, delta=delta)]))
                    reason = "tool_calls" if "tool_calls" in delta else reason
            end = ChatChunkChoice(
                index=self.index, delta={}, finish_reason=reason, stop_reason=out.stop_reason
            )
            chunks.append(self.chunk([end]))
        return chunks

    def _content(self, text: str) -> str:
        """With tools, the content that may go now: an auto answer up to a (possible) <tool_call>; nothing of a
        required or named one, which is a call by construction."""
        self.answer += text
        if self.tool_plan.mode != "auto":
            return ""
        upto = streamable_len(self.answer)
        delta, self.sent = self.answer[self.sent : upto], max(self.sent, upto)
        return delta

    def _tool_delta(self) -> dict:
        """The end of an answer with tools: its calls, whole, in one delta; or the content held back."""
        _, calls = parse(self.answer, self.tool_plan)
        if calls:
            return {"tool_calls": [{"index": i, **call.model_dump()} for i, call in enumerate(calls)]}
        rest = self.answer[self.sent :]
        return {"content": rest} if rest else {}


@dataclass(slots=True)
class CompletionStream:
    head: Head
    index: int
    num_logprobs: int | None
    texts: TokenTexts
    echo: str = ""  # the prompt's text, sent first (echo)
    offset: int = 0  # text_offset of the next token

    def chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        h = self.head
        return Completion(
            id=h.id, created=h.created, model=h.model, choices=choices, usage=usage or h.usage()
        ).model_dump_json()

    def open(self) -> list[str]:
        return (
            [self.chunk([CompletionChoice(index=self.index, text=self.echo, finish_reason=None)])]
            if self.echo
            else []
        )

    def __call__(self, out: RequestOutput) -> list[str]:
        logprobs = None
        ids, entries = shown_tokens(out)
        if self.num_logprobs is not None and entries:
            logprobs = completion_logprobs(ids, entries, self.num_logprobs, self.texts, self.offset)
            self.offset += sum(len(t) for t in logprobs.tokens)
        if not (out.text or logprobs is not None or out.finished):
            return []
        choice = CompletionChoice(index=self.index, text=out.text, logprobs=logprobs,
                                  finish_reason=out.finish_reason, stop_reason=out.stop_reason)  # fmt: skip
        return [self.chunk([choice])]


class Streams:
    """The SSE renderer of one request's n choices (``streaming.sse`` drives it)."""

    def __init__(
        self, head: Head, n: int, include_usage: bool, make: Callable[[int], ChatStream | CompletionStream]
    ):
        self.head, self.include_usage = head, include_usage
        self.streams = [make(index) for index in range(n)]

    def open(self) -> list[str]:
        return [chunk for stream in self.streams for chunk in stream.open()]

    def __call__(self, index: int, out: RequestOutput) -> list[str]:
        self.head.usages.add(index, out)
        return self.streams[index](out)

    def close(self) -> list[str]:
        if not self.include_usage:
            return []
        return [self.streams[0].chunk([], self.head.usage(final=True))]
