"""AsyncEngine: LLMEngine on a background thread, with one asyncio stream of RequestOutput per request.

Only the engine thread touches the LLMEngine (no lock around the GPU step): callers hand it commands (add,
abort) through a condition variable, and outputs come back to each request's event loop through
loop.call_soon_threadsafe. The thread sleeps on the condition while there is no work, and also while every
request waits for an adapter (a step that runs nothing): it then blocks until a load ends, a request
arrives or is aborted, or a command comes, so it never spins against the loader. A client that stops
reading (closes the stream, breaks out of its loop, or is cancelled) aborts its request, which frees the KV
blocks. A request that fails on its own (refused on the engine thread, or failing inside a step) raises on
its stream alone (RequestError for a failure inside a step) while the others go on. If the loop dies (a device
fault), every open stream raises EngineDeadError instead of hanging.

Adapter management (load, warm, alias, pin, unload; ``AdapterCommands`` in adapter_commands.py) goes
through the same command queue when it touches the device, so only the engine thread ever does; the HTTP
side sees ``info()``, ``adapters()`` and the types of api.py, never the engine's internals.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from loraplane.engine.api import (
    MEMORY_USES,
    AdapterError,
    AdapterInfo,
    AdapterLease,
    EngineInfo,
    QueueStats,
    StepStats,
)
from loraplane.engine.core.adapter_commands import AdapterCommands, _Call, _run_call
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.errors import EngineDeadError, RequestError
from loraplane.engine.core.llm_engine import LLMEngine, RequestOutput
from loraplane.engine.core.sequence import SamplingParams
from loraplane.engine.model.detokenizer import TokenizerLike


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


class AsyncEngine(AdapterCommands):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[_Add | _Call | str] = []  # a str is a request id to abort
        self._streams: dict[str, _Stream] = {}  # open streams by request id; guarded by _cond
        self._error: BaseException | None = None
        self._closed = False
        self._adapter_of: dict[str, str] = {}  # request id -> adapter key, while the request lives
        self._step_listeners: list[Callable[[StepStats], None]] = []
        self._woken = False  # a load ended since the loop last looked (guarded by _cond)
        self._queues = QueueStats(updated_at=time.time())  # replaced whole by the engine thread
        lora = self._lora(None)
        if lora is not None:
            lora.waker = self._wake
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
        lease: AdapterLease | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; returns its stream of outputs (one per token). Bad requests raise ValueError now.
        ``lease``: a live lease on ``adapter`` lets the request start on it even once its unload has begun."""
        sampling = sampling if sampling is not None else SamplingParams()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        prompt_token_ids = list(prompt_token_ids)
        self.engine.check_request(prompt_token_ids, sampling)
        if adapter is not None:  # AdapterError('AdapterNotFound') for unknown or unloaded adapters
            lora = self._lora(None)
            if lora is None:
                raise AdapterError("AdapterNotFound", f"adapter {adapter!r}: this engine serves no adapters")
            # Counted in flight from here: an unload between now and the engine thread taking the request
            # (a step's end frees unloading versions) waits for it instead of freeing its weights.
            lora.hold(adapter, leased=lease is not None and lease.live and lease.key == adapter)
        stream = _Stream(asyncio.get_running_loop())
        try:
            with self._cond:
                self._raise_if_dead()
                if request_id in self._streams:
                    raise ValueError(f"request_id: {request_id!r} is already running")
                self._streams[request_id] = stream
                self._commands.append(_Add(request_id, prompt_token_ids, sampling, adapter))
                self._cond.notify()
        except BaseException:
            if adapter is not None:
                self._note_request(adapter, -1)
            raise
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

    # --- adapters and facts (any thread; device work is handed to the engine thread) -------------------
    def info(self) -> EngineInfo:
        runner, lora = self.engine.runner, self._lora(None)
        targets: tuple[str, ...] = ()
        if lora is not None:
            from loraplane.engine.lora.weights import TARGET_MODULES

            targets = TARGET_MODULES
        return EngineInfo(
            base_hash=runner.base_hash,
            max_model_len=self.engine.max_model_len,
            vocab_size=runner.vocab_size,
            max_lora_rank=self.engine.config.max_lora_rank if lora is not None else 0,
            target_modules=targets,
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            max_loras=_full_rank_slots(lora.gpu.pools) if lora is not None else 0,
            kv_block_size=self.engine.config.block_size,
        )

    def queue_stats(self) -> QueueStats:
        """Running and waiting requests and their adapters (routers read them through the metrics)."""
        return self._queues

    def adapters(self, name: str | None = None) -> list[AdapterInfo]:
        """Every adapter version held, or only ``name``'s."""
        lora = self._lora(None)
        return [] if lora is None else lora.infos(name)

    def resolve(self, name: str) -> str | None:
        """Alias ``name`` -> the serving ``name@version``; None when no version serves it."""
        lora = self._lora(None)
        return None if lora is None else lora.resolve(name)

    def tier_of(self, adapter_key_: str) -> str | None:
        lora = self._lora(None)
        return None if lora is None else lora.tier_of(adapter_key_)

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        """``fn(StepStats)`` after every step, on the engine thread (keep it short; errors are dropped)."""
        self._step_listeners.append(fn)

    def _after_step(self) -> None:
        lora = self._lora(None)
        if lora is not None:
            lora.poll()  # frees unloaded versions whose last request just finished
        if not self._step_listeners:
            return
        stats = self.engine.stats()
        tokens, seqs, adapters = lora.last_step if lora is not None else (0, stats.num_running, 0)
        gpu = lora.tier_stats()["gpu"] if lora is not None else {"bytes": 0, "capacity": 0}
        unified = stats.unified_memory
        memory = None if unified is None else {use: int(unified[f"bytes_{use}"]) for use in MEMORY_USES}
        step = StepStats(tokens, seqs, adapters, stats.num_kv_blocks - stats.num_free_kv_blocks,
                         stats.num_kv_blocks, gpu["bytes"], gpu["capacity"], memory)  # fmt: skip
        for fn in self._step_listeners:
            try:
                fn(step)
            except Exception:  # noqa: BLE001, S110 - a listener (metrics) must never stop serving
                pass

    def _publish_queues(self) -> None:
        """Snapshot the scheduler's queues for other threads (one reference swap; readers never lock)."""
        scheduler, blocks = self.engine.scheduler, self.engine.scheduler.block_manager
        queues = QueueStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks,
            kv_blocks_total=blocks.num_blocks,
            running_adapters=frozenset(s.adapter for s in scheduler.running if s.adapter is not None),
            waiting_adapters=frozenset(s.adapter for s in scheduler.waiting if s.adapter is not None),
            updated_at=self._queues.updated_at,
        )
        if queues != self._queues:  # the timestamp moves only when something changed
            self._queues = replace(queues, updated_at=time.time())

    def is_alive(self) -> bool:
        """True while the loop thread runs and has neither failed nor been closed (readiness probes)."""
        return self._error is None and not self._closed and self._thread.is_alive()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}") from self._error
        if self._closed:
            raise EngineDeadError("engine is closed")

    def close(self) -> None:
        """Stop the loop thread, then the adapter tiers' loader and host arena; open streams raise
        EngineDeadError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        tiers = getattr(self.engine.runner, "lora", None)  # runners without adapters have none
        if tiers is not None:
            tiers.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def _wake(self) -> None:
        """An adapter load ended (any thread): a stalled loop steps again."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    # --- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            idle_wait: float | None = None  # the last step ran nothing: block this long at most
            while True:
                with self._cond:
                    if idle_wait is not None and not (self._commands or self._closed or self._woken):
                        self._cond.wait(idle_wait)
                    while not (self._commands or self._closed or self.engine.has_unfinished()):
                        self._cond.wait()
                    if self._closed:
                        break
                    commands, self._commands, self._woken = self._commands, [], False
                self._apply(commands)
                idle_wait = None
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                    self._after_step()
                    idle_wait = self.engine.idle_wait_s()
                self._publish_queues()
        except BaseException as error:  # noqa: BLE001 - every failure must reach the streams
            self._fail(error)
            return
        self._fail(EngineDeadError("engine closed"))

    def _apply(self, commands: list[_Add | _Call | str]) -> None:
        for command in commands:
            if isinstance(command, str):
                self.engine.abort(command)
                continue
            if isinstance(command, _Call):
                _run_call(command)
                continue
            try:
                self.engine.add_request(
                    command.prompt_token_ids, command.sampling, command.request_id, command.adapter
                )
            except Exception as error:  # noqa: BLE001 - refused (bad values, overload): this request, not the engine
                if command.adapter is not None:
                    self._note_request(command.adapter, -1)  # held since add_request
                self._send_error(command.request_id, error)
                continue
            if command.adapter is not None:  # counted in flight since add_request; released at its end
                self._adapter_of[command.request_id] = command.adapter

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = defaultdict(list)
        for out in outputs:
            if out.finished and out.request_id in self._adapter_of:
                self._note_request(self._adapter_of.pop(out.request_id), -1)
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
            calls = [c for c in self._commands if isinstance(c, _Call)]
            self._commands = []
        for call in calls:
            call.future.set_exception(EngineDeadError(f"engine loop stopped: {error!r}"))
        for stream in streams.values():
            self._call_soon(stream.loop, _put_all, [(stream, error)])

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, callback, items) -> None:
        try:
            loop.call_soon_threadsafe(callback, items)
        except RuntimeError:  # that event loop is closed: nobody is left to read
            pass


def _full_rank_slots(pools) -> int:
    """Adapters of the largest rank the GPU pools hold at once (more fit when ranks are lower)."""
    return min(min(p.max_adapters, p.num_pages // p.max_pages) for p in pools.values())


def _put_all(items: list[tuple[_Stream, RequestOutput | _Failed | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
