"""Watch streams: events from the store's history and live mutations, as newline-delimited JSON.

``resourceVersion`` replays history after it (absent or "0": a synthetic ADDED per object first);
a version older than the bounded history gets an ERROR event with a 410 Expired Status, as the real
server streams it; ``timeoutSeconds`` ends the stream; ``allowWatchBookmarks`` adds a BOOKMARK with
the current resourceVersion every ``bookmark_interval`` seconds; ``sendInitialEvents=true`` ends the
initial ADDED burst with the ``k8s.io/initial-events-end`` bookmark. Selector transitions become
ADDED/DELETED, as the watch cache does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp.web

from tests.kube.errors import JSON, ApiError

if TYPE_CHECKING:
    from tests.kube.store import Store

Send = Callable[[str, dict[str, Any]], Awaitable[None]]


@dataclasses.dataclass(slots=True, frozen=True)
class Event:
    rv: int
    type_key: tuple[str, str]
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclasses.dataclass(slots=True)
class Watcher:
    type_key: tuple[str, str]
    namespace: str | None
    matches: Callable[[dict[str, Any]], bool]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def offer(self, event: Event) -> None:
        out = self.translate(event)
        if out is not None and not self.loop.is_closed():  # a stopped emulator has no streams to feed
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)

    def translate(self, event: Event) -> tuple[str, dict[str, Any]] | None:
        """Selector transitions become ADDED/DELETED, as the real watch cache does."""
        if event.type_key != self.type_key:
            return None
        if self.namespace is not None and event.obj["metadata"].get("namespace") != self.namespace:
            return None
        now = self.matches(event.obj)
        before = event.old is not None and self.matches(event.old)
        if event.type == "MODIFIED":
            if now and not before:
                return ("ADDED", event.obj)
            if before and not now:
                return ("DELETED", event.obj)
        return (event.type, event.obj) if now else None


@dataclasses.dataclass(slots=True)
class WatchRequest:
    type_key: tuple[str, str]
    namespace: str | None
    matches: Callable[[dict[str, Any]], bool]
    since: int | None  # None: start with a synthetic ADDED per existing object
    timeout: float | None
    bookmarks: bool
    initial_events_end: bool
    kind: str
    api_version: str


async def serve_watch(
    raw: aiohttp.web.BaseRequest,
    store: Store,
    request: WatchRequest,
    render: Callable[[str, dict[str, Any]], dict[str, Any]],
    closing: asyncio.Event,
    bookmark_interval: float,
) -> aiohttp.web.StreamResponse:
    queue: asyncio.Queue = asyncio.Queue()
    watcher = Watcher(request.type_key, request.namespace, request.matches, asyncio.get_running_loop(), queue)
    response = aiohttp.web.StreamResponse(headers={"Content-Type": JSON})
    try:
        backlog = store.subscribe(watcher, request.since)
    except ApiError as e:  # the real server answers 200 and streams the Status as an ERROR event
        await response.prepare(raw)
        await response.write(json.dumps({"type": "ERROR", "object": e.body()}).encode() + b"\n")
        await response.write_eof()
        return response

    def bookmark(initial_end: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"resourceVersion": str(store.resource_version)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"kind": request.kind, "apiVersion": request.api_version, "metadata": meta}

    async def send(type_: str, obj: dict[str, Any]) -> None:
        body = obj if type_ == "BOOKMARK" else render(type_, obj)
        await response.write(json.dumps({"type": type_, "object": body}).encode() + b"\n")

    try:
        response.enable_chunked_encoding()
        await response.prepare(raw)
        for type_, obj in backlog:
            await send(type_, obj)
        if request.initial_events_end and request.bookmarks:
            await send("BOOKMARK", bookmark(initial_end=True))
        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        next_bookmark = time.monotonic() + bookmark_interval
        while not closing.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if request.bookmarks and now >= next_bookmark:
                await send("BOOKMARK", bookmark())
                next_bookmark = now + bookmark_interval
            wakeups = [
                t - now for t in (deadline, next_bookmark if request.bookmarks else None) if t is not None
            ]
            try:
                item = await asyncio.wait_for(queue.get(), timeout=max(min([0.5, *wakeups]), 0.001))
            except TimeoutError:
                if raw.transport is None or raw.transport.is_closing():  # the client went away
                    break
                continue
            if item is None:  # the emulator is shutting down
                break
            await send(*item)
        await response.write_eof()
    except (ConnectionResetError, asyncio.CancelledError, aiohttp.ClientConnectionResetError):
        pass
    finally:
        store.unsubscribe(watcher)
    return response
