"""``n`` choices of one request: n engine requests on one prompt, their outputs merged as (index, output).

As vLLM does, each choice is a request of its own in the engine (choice i of a seeded request draws with
seed + i). The first one starts alone; the others start once it has produced its first token, when its
prompt's full KV blocks are in the prefix cache, so they share those blocks instead of computing the
prompt n times. The key's admission (concurrency slot, prompt tokens) counts the request once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from loraplane.engine.api import AdapterLease
from loraplane.http.limits import Ticket
from loraplane.http.usage import RequestMeter, unmetered

if TYPE_CHECKING:
    from loraplane.engine.core.llm_engine import RequestOutput

_END = object()


class HeldTicket:
    """The key's ticket as each choice sees it: tokens count, releasing waits for the request as a whole."""

    __slots__ = ("ticket",)

    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket

    def add_tokens(self, tokens: int) -> None:
        self.ticket.add_tokens(tokens)

    def release(self) -> None:
        pass


def child_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def child_sampling(sampling, index: int):
    """Choice ``index``'s SamplingParams: a seeded request's choices draw different tokens, reproducibly."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % (1 << 63))


Start = Callable[[int, str], AsyncIterator["RequestOutput"]]


class Choices:
    """Starts choice 0 now (a refusal raises here, before any answer), the rest after its first output."""

    def __init__(self, request_id: str, n: int, start: Start, ticket: Ticket | None = None,
                 meter: RequestMeter | None = None, lease: AdapterLease | None = None) -> None:  # fmt: skip
        self.n, self.ids, self._start, self._ticket = n, child_ids(request_id, n), start, ticket
        self._lease = lease  # keeps the adapter version until the last choice has started
        self.meter = meter if meter is not None else unmetered()  # the route lets go of it (streaming.py)
        self.started: list[str] = [self.ids[0]]  # engine request ids to abort when the client leaves
        self._first = start(0, self.ids[0])

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if self.n == 1:
            async for out in self._first:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(0, self._first, queue))]
        live, waiting = 1, True
        try:
            while live:
                index, item = await queue.get()
                if waiting:  # choice 0 has its first token (or ended): its prompt blocks are cached
                    waiting = False
                    for k in range(1, self.n):
                        stream = self._start(k, self.ids[k])
                        self.started.append(self.ids[k])
                        tasks.append(asyncio.create_task(_pump(k, stream, queue)))
                        live += 1
                    self._let_go()  # each started choice now holds the version itself
                if item is _END:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._let_go()
            if self._ticket is not None:
                self._ticket.release()

    def _let_go(self) -> None:
        if self._lease is not None:
            self._lease.release()


async def _pump(index: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
    try:
        async for out in stream:
            queue.put_nowait((index, out))
        queue.put_nowait((index, _END))
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it for the request
        queue.put_nowait((index, exc))
    finally:
        await stream.aclose()
