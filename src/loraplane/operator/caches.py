"""The operator's in-memory caches. Each saves work for one module, none is a source of truth, and all are
rebuilt after a restart: state lives in the API (specs, status) and in the pods (GET /admin/adapters).

| cache | owner | holds |
|---|---|---|
| ``SharedResults`` | validation.py | verified manifests by validation key; concurrent asks share one S3 read |
| ``Memo`` | validation.py | boto3 clients by (endpoint, region, credentials hash) |
| ``Snapshots`` | pod_ops.py | each pod's adapter listing, shared for ``poll_interval`` seconds |
| ``Fingerprints`` | handlers.py | what a base's adapters care about (generation, ready pods, base hash) |
| ``StatusEcho`` | publish.py | the object our last status patch returned, newer than the watch's copy |
| ``Backoff`` | context.py | consecutive failures per key, for exponential retry delays |
| ``Expiring`` | kube.py | Secrets read by name, for ``ttl`` seconds; concurrent misses share one GET |
| ``Quiet`` | reconcile_adapter.py | what an adapter's last settled pass read and saw, so an idle drift check can stop early |
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

STALE_AFTER = 300.0  # seconds after which a pod's listing is dropped from Snapshots
FULL_PASS_EVERY = 300.0  # seconds: an adapter found quiet still gets a full pass (Secrets, policy) this often
MAX_ENTRIES = 4096  # far above what one namespace holds; a bound so a churn of names cannot grow memory


@dataclass(slots=True)
class SharedResults(Generic[K, V]):
    """Finished results in LRU order, and the one running fetch per key that concurrent callers share."""

    max_entries: int = MAX_ENTRIES
    _done: OrderedDict[K, V] = field(default_factory=OrderedDict)
    _running: dict[K, asyncio.Future] = field(default_factory=dict)

    async def get(self, key: K, fetch: Callable[[], Awaitable[V]]) -> V:
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key]
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = asyncio.ensure_future(fetch())
            running.add_done_callback(lambda _: self._running.pop(key, None))
        value = await asyncio.shield(running)  # one caller's cancellation must not cancel the others' fetch
        self._done[key] = value
        self._done.move_to_end(key)
        while len(self._done) > self.max_entries:
            self._done.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._done)


@dataclass(slots=True)
class Expiring(Generic[K, V]):
    """Values kept ``ttl`` seconds from when their read began. Concurrent misses of one key share one fetch:
    thousands of passes asking for the same Secret while its entry expires make one GET, not one each (a
    read queued behind a busy API server takes seconds, and every pass in those seconds would miss). A
    fetch answering None (absent) is shared but not kept: the next ask reads again."""

    max_entries: int = MAX_ENTRIES
    _values: dict[K, tuple[float, V]] = field(default_factory=dict)
    _running: dict[K, asyncio.Future] = field(default_factory=dict)

    async def get(self, key: K, ttl: float, fetch: Callable[[], Awaitable[V | None]]) -> V | None:
        kept = self._values.get(key)
        if kept is not None and time.monotonic() - kept[0] < ttl:
            return kept[1]
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = asyncio.ensure_future(self._fetch(key, fetch))
            running.add_done_callback(lambda done: self._settled(key, done))
        return await asyncio.shield(running)  # one caller's cancellation must not cancel the others' read

    async def _fetch(self, key: K, fetch: Callable[[], Awaitable[V | None]]) -> V | None:
        began = time.monotonic()
        value = await fetch()
        if value is None:
            self._values.pop(key, None)
        elif self._running.get(key) is asyncio.current_task():  # not forgotten while it ran
            if len(self._values) >= self.max_entries:
                self._values.clear()
            self._values[key] = (began, value)
        return value

    def _settled(self, key: K, done: asyncio.Future) -> None:
        if self._running.get(key) is done:
            del self._running[key]

    def forget(self, key: K) -> None:
        """The value changed (or may have): the next ask reads it again, even while a read is running."""
        self._values.pop(key, None)
        self._running.pop(key, None)


@dataclass(slots=True)
class Memo(Generic[K, V]):
    """Values that are costly to build and never go stale (clients)."""

    _values: dict[K, V] = field(default_factory=dict)

    def get(self, key: K, make: Callable[[], V]) -> V:
        if key not in self._values:
            self._values[key] = make()
        return self._values[key]


@dataclass(slots=True)
class Snapshots(Generic[K, V]):
    """One listing per key, shared by every caller for ``max_age`` seconds, dropped when we act on the key."""

    max_entries: int = MAX_ENTRIES
    _taken: dict[K, tuple[float, asyncio.Future]] = field(default_factory=dict)
    stale_after: float = STALE_AFTER
    _swept: float = float("-inf")

    async def get(self, key: K, max_age: float, take: Callable[[], Awaitable[V]]) -> V:
        now = asyncio.get_running_loop().time()
        taken = self._taken.get(key)
        if taken is None or now - taken[0] >= max_age:
            self._drop_stale(now)
            if len(self._taken) > self.max_entries:
                self._taken.clear()
            taken = self._taken[key] = (now, asyncio.ensure_future(take()))
        return await asyncio.shield(taken[1])

    def _drop_stale(self, now: float) -> None:
        """Listings older than ``stale_after`` are never served again (every caller asks for a few seconds' age):
        drop them, so a pod that is gone (a new name and address each time one is replaced) leaves nothing."""
        if now - self._swept < self.stale_after / 5:
            return
        self._swept = now
        for key in [
            k
            for k, (when, listing) in self._taken.items()
            if now - when > self.stale_after and listing.done()
        ]:
            del self._taken[key]

    def drop(self, key: K) -> None:
        self._taken.pop(key, None)

    def drop_if(self, gone: Callable[[K], bool]) -> None:
        """Drop the listings of every key ``gone`` says is gone (a deleted pod's, at once: its name and
        address never come back, so waiting ``stale_after`` for it only keeps memory)."""
        for key in [k for k in self._taken if gone(k)]:
            del self._taken[key]

    def amend(self, key: K, update: Callable[[V], V]) -> None:
        """Replace a taken listing by ``update(listing)``, keeping its age: what one caller just observed of
        its own part. Each of thousands of adapters that acts on a pod would otherwise drop the listing and
        make the next one list the whole pod again (a listing per adapter, each as long as the pod's list).
        A listing still in flight may predate the caller's act: it is dropped instead."""
        taken = self._taken.get(key)
        if taken is None:
            return
        when, listing = taken
        if not listing.done() or listing.cancelled() or listing.exception() is not None:
            self._taken.pop(key, None)
            return
        amended = asyncio.get_running_loop().create_future()
        amended.set_result(update(listing.result()))
        self._taken[key] = (when, amended)


@dataclass(slots=True)
class Fingerprints(Generic[K]):
    _seen: dict[K, Any] = field(default_factory=dict)

    def changed(self, key: K, fingerprint: Any) -> bool:
        """True (and remembered) when ``fingerprint`` differs from the last one seen for ``key``."""
        if self._seen.get(key) == fingerprint:
            return False
        self._seen[key] = fingerprint
        return True

    def forget(self, key: K) -> None:
        self._seen.pop(key, None)


@dataclass(slots=True)
class StatusEcho:
    """What our own status patches returned: a watch event can arrive older than our last write."""

    _latest: dict[str, dict] = field(default_factory=dict)

    def remember(self, path: str, written: dict) -> None:
        self._latest[path] = written

    def forget(self, path: str) -> None:
        self._latest.pop(path, None)

    def newest(self, path: str, body: dict) -> dict:
        """``body`` (from the watch), or what our last status patch returned if that is newer."""
        mine = self._latest.get(path)
        if mine is None:
            return body
        theirs_rv = str(body.get("metadata", {}).get("resourceVersion", ""))
        mine_rv = str(mine.get("metadata", {}).get("resourceVersion", ""))
        if theirs_rv.isdigit() and mine_rv.isdigit() and int(mine_rv) > int(theirs_rv):
            return mine
        self._latest.pop(path, None)
        return body


@dataclass(slots=True)
class Backoff(Generic[K]):
    _failures: dict[K, int] = field(default_factory=dict)

    def delay(self, key: K, failed: bool, *, steady: float, first: float, longest: float) -> float:
        """Exponential from ``first`` up to ``longest`` while failing; ``steady`` ±10% after a success, so
        thousands of daemons started together do not check their pods in bursts."""
        if not failed:
            self._failures.pop(key, None)
            return steady * random.uniform(0.9, 1.1)
        count = self._failures[key] = self._failures.get(key, 0) + 1
        return min(longest, first * 2 ** (count - 1))

    def reset(self, key: K) -> None:
        self._failures.pop(key, None)


@dataclass(slots=True)
class Quiet(Generic[K]):
    """Per adapter, what its last settled pass read (its object's and its base's resourceVersion, the ready
    pods) with what it needs to look again (the admin token, the pods it is placed on) and what the pods held of
    it. A drift check whose reads are unchanged only looks at the pods; at thousands of adapters the full pass
    (spec models, policy, Secrets, status comparison) made the idle operator's CPU grow with adapters x time."""

    full_every: float = FULL_PASS_EVERY
    max_entries: int = MAX_ENTRIES
    _kept: dict[K, tuple[Any, Any, float]] = field(default_factory=dict)  # key -> (reads, seen, when)

    def remember(self, key: K, reads: Any, seen: Any) -> None:
        if len(self._kept) >= self.max_entries and key not in self._kept:
            self._kept.clear()
        self._kept[key] = (reads, seen, time.monotonic())

    def seen(self, key: K, reads: Any) -> Any | None:
        """What the last settled pass saw, if it read the same and is recent enough; else None."""
        kept = self._kept.get(key)
        if kept is None or kept[0] != reads or time.monotonic() - kept[2] >= self.full_every:
            return None
        return kept[1]

    def forget(self, key: K) -> None:
        self._kept.pop(key, None)
