"""AsyncEngine: LLMEngine on a background thread, with one asyncio stream of RequestOutput per request.

Only the engine thread touches the LLMEngine (no lock around the GPU step): callers hand it commands (add,
abort) through a condition variable, and outputs come back to each request's event loop through
loop.call_soon_threadsafe. The thread sleeps on the condition while there is no work. A client that stops
reading (closes the stream, breaks out of its loop, or is cancelled) aborts its request, which frees the KV
blocks. A request that fails on its own (refused on the engine thread, or failing inside a step) raises on
its stream alone (RequestError for a failure inside a step) while the others go on. If the loop dies (a device
fault), every open stream raises EngineDeadError instead of hanging.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .config import EngineConfig
from .detokenizer import TokenizerLike
from .llm_engine import LLMEngine, RequestError, RequestOutput
from .sequence import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop stopped (it failed, or the engine was closed); no more outputs will come."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass(slots=True)
class _Failed:
    """One request's own error (refused on the engine thread): its stream raises it, the engine goes on."""

    error: BaseException


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter: str | None


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[_Add | str] = []  # a str is a request id to abort
        self._streams: dict[str, _Stream] = {}  # open streams by request id; guarded by _cond
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="loraplane-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer: TokenizerLike | None = None) -> AsyncEngine:
        """Build the engine (and its model runner) in the calling thread, then start the loop thread."""
        return cls(LLMEngine(config, tokenizer=tokenizer))

    # --- the caller's side (event loop threads) ------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; returns its stream of outputs (one per token). Bad requests raise ValueError now."""
        sampling = sampling if sampling is not None else SamplingParams()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        prompt_token_ids = list(prompt_token_ids)
        self.engine.check_request(prompt_token_ids, sampling)
        stream = _Stream(asyncio.get_running_loop())
        with self._cond:
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already running")
            self._streams[request_id] = stream
            self._commands.append(_Add(request_id, prompt_token_ids, sampling, adapter))
            self._cond.notify()
        return self._read(request_id, stream)

    generate = add_request

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream (if still read) ends with finish_reason 'abort'. Unknown ids are ignored."""
        with self._cond:
            if not self._closed:
                self._commands.append(request_id)
                self._cond.notify()

    async def _read(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, _Failed):
                    finished = True
                    raise item.error
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineDeadError(f"engine loop stopped: {item!r}") from item
                finished = item.finished
                if item.error is not None:  # failed inside a step: the others went on
                    raise RequestError(request_id, item.error)
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the client went away early: free its blocks
                with self._cond:
                    self._streams.pop(request_id, None)
                self.abort(request_id)

    def is_alive(self) -> bool:
        """True while the loop thread runs and has neither failed nor been closed (readiness probes)."""
        return self._error is None and not self._closed and self._thread.is_alive()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}") from self._error
        if self._closed:
            raise EngineDeadError("engine is closed")

    def close(self) -> None:
        """Stop the loop thread; open streams raise EngineDeadError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    # --- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._closed or self.engine.has_unfinished()):
                        self._cond.wait()
                    if self._closed:
                        break
                    commands, self._commands = self._commands, []
                self._apply(commands)
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
        except BaseException as error:  # noqa: BLE001 - every failure must reach the streams
            self._fail(error)
            return
        self._fail(EngineDeadError("engine closed"))

    def _apply(self, commands: list[_Add | str]) -> None:
        for command in commands:
            if isinstance(command, str):
                self.engine.abort(command)
                continue
            try:
                self.engine.add_request(
                    command.prompt_token_ids, command.sampling, command.request_id, command.adapter
                )
            except Exception as error:  # noqa: BLE001 - refused (bad values, overload): this request, not the engine
                self._send_error(command.request_id, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = defaultdict(list)
        with self._cond:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # its client already left
                if out.finished:
                    del self._streams[out.request_id]
                by_loop[stream.loop].append((stream, out))
        for loop, items in by_loop.items():
            self._call_soon(loop, _put_all, items)

    def _send_error(self, request_id: str, error: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._call_soon(stream.loop, _put_all, [(stream, _Failed(error))])

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None and not isinstance(error, EngineDeadError):
                self._error = error
            self._closed = True
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            self._call_soon(stream.loop, _put_all, [(stream, error)])

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, callback, items) -> None:
        try:
            loop.call_soon_threadsafe(callback, items)
        except RuntimeError:  # that event loop is closed: nobody is left to read
            pass


def _put_all(items: list[tuple[_Stream, RequestOutput | _Failed | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
