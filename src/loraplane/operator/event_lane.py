"""Events' own lane to the API server: a few threads, a short timeout, a bounded backlog, duplicates merged.

An Event is auxiliary; a status patch is not. When a server pod is replaced, thousands of adapters write
their status and post an Event at once; had the Events shared the reconcile calls' threads, every status
patch behind them would wait, and a slow API server (30 s per call) would stall reconciles for an hour.
Here the Events have their own threads (``EVENT_THREADS``), each post gives up after ``EVENT_TIMEOUT`` s,
and what waits is a backlog of at most ``EVENT_BACKLOG`` Events: when it is full the oldest is dropped
(counted in ``loraplane_operator_events_dropped_total``). An Event identical to one still waiting (same
object, type, reason and message) bumps that one's ``count`` and ``lastTimestamp`` instead of queueing a
second, as client-go's EventCorrelator does. A failure to post is logged, never raised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime

from prometheus_client import Counter

log = logging.getLogger(__name__)

EVENT_SOURCE = "loraplane-operator"  # an Event's source.component: the "From" column of `kubectl describe`
EVENT_MESSAGE_MAX = 1024
EVENT_THREADS = 2  # Events in flight at once; never the reconcile calls' threads
EVENT_TIMEOUT = 5.0  # seconds one post may take before it is given up
EVENT_BACKLOG = 1000  # Events waiting at most; beyond it the oldest is dropped
DROP_LOG_EVERY = 60.0  # seconds between log lines about dropped Events

EVENTS_DROPPED = Counter(
    "loraplane_operator_events_dropped_total",
    "Events dropped unposted because the Event backlog was full (the API server was slow or down).",
)


def event_body(obj: dict, type_: str, reason: str, message: str) -> dict:
    """The Event kopf wrote, field for field: involvedObject, reason, message, type, source, timestamps, count."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    involved = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta.get("name"),
                "namespace": namespace, "uid": meta.get("uid")}  # fmt: skip
    now = _now()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"namespace": namespace, "generateName": f"{meta.get('name') or 'object'}."},
        "involvedObject": {k: v for k, v in involved.items() if v},
        "reason": reason,
        "message": message[:EVENT_MESSAGE_MAX],
        "type": type_,
        "source": {"component": EVENT_SOURCE},
        "reportingComponent": EVENT_SOURCE,
        "reportingInstance": EVENT_SOURCE,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _identity(body: dict) -> tuple:
    """What makes two Events the same Event: the object (by uid, else by where it lives), type, reason, message."""
    obj = body["involvedObject"]
    who = obj.get("uid") or (obj.get("namespace"), obj.get("kind"), obj.get("name"))
    return who, body["type"], body["reason"], body["message"]


class EventLane:
    """Posts Events through ``post`` (blocking: it runs in the lane's own threads) from a bounded backlog."""

    def __init__(
        self, post: Callable[[dict], object], threads: int = EVENT_THREADS, backlog: int = EVENT_BACKLOG
    ):
        if threads < 1 or backlog < 1:
            raise ValueError("EventLane threads and backlog must be >= 1")
        self._post = post
        self._threads = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kube-event")
        self.width = threads
        self.backlog = backlog
        self._waiting: OrderedDict[tuple, dict] = OrderedDict()  # identity -> body, oldest first
        self._drainers: set[asyncio.Task] = set()  # at most ``width``; each ends when the backlog is empty
        self.dropped = 0
        self._dropped_logged = (-DROP_LOG_EVERY, 0)  # (when, how many had been dropped then)

    def submit(self, body: dict) -> None:
        """Queue ``body`` (or merge it into an identical waiting Event); the caller does not wait."""
        key = _identity(body)
        waiting = self._waiting.get(key)
        if waiting is not None:
            waiting["count"] += 1
            waiting["lastTimestamp"] = body["lastTimestamp"]
        else:
            if len(self._waiting) >= self.backlog:
                self._waiting.popitem(last=False)
                self._count_drop()
            self._waiting[key] = body
        loop = asyncio.get_running_loop()
        self._drainers = {t for t in self._drainers if not t.done()}  # a closed loop's, cancelled
        while len(self._drainers) < min(self.width, len(self._waiting)):
            task = loop.create_task(self._drain())
            self._drainers.add(task)
            task.add_done_callback(lambda done: self._drainers.discard(done))

    async def send(self, body: dict) -> bool:
        """Post ``body`` now in the lane's threads: True when posted; a failure is logged, never raised."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._threads, self._post, body)
            return True
        except Exception as exc:  # noqa: BLE001 - an Event must never fail the pass that posts it
            log.warning("could not post the Event %s %s on %s/%s: %s", body["type"], body["reason"],
                        body["metadata"]["namespace"], body["involvedObject"].get("name"), exc)  # fmt: skip
            return False

    async def flush(self) -> None:
        """Wait until every waiting Event has been posted or given up (tests; a clean shutdown)."""
        while running := [t for t in self._drainers if not t.done()]:
            await asyncio.gather(*running)

    def waiting(self) -> int:
        return len(self._waiting)

    async def _drain(self) -> None:
        while self._waiting:
            _, body = self._waiting.popitem(last=False)
            await self.send(body)

    def _count_drop(self) -> None:
        self.dropped += 1
        EVENTS_DROPPED.inc()
        when, logged = self._dropped_logged
        if time.monotonic() - when >= DROP_LOG_EVERY:  # once in a while, not once per Event
            log.info("the Event backlog is full (%d): dropped %d Events (%d since the last report)",
                     self.backlog, self.dropped, self.dropped - logged)  # fmt: skip
            self._dropped_logged = (time.monotonic(), self.dropped)
