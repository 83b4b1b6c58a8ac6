"""What every handler shares: clients, tunables, wake-up events. Nothing here is a source of truth.

State lives in the API (specs, status) and in the pods (GET /admin/adapters); the caches below only
save work (a validated manifest, a Secret read a moment ago) and are rebuilt after a restart.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from loraplane.operator.admin_client import AdminClient
from loraplane.operator.builders import ADMIN_PORT
from loraplane.operator.kube import Kube
from loraplane.operator.policy import OperatorPolicy

DEFAULT_DRIFT_INTERVAL = 30.0


@dataclass(slots=True)
class Tunables:
    drift_interval: float = (
        DEFAULT_DRIFT_INTERVAL  # seconds between drift checks of a converged adapter or base
    )
    poll_interval: float = 2.0  # while a pod is still pulling or warming
    retry_delay: float = 5.0  # first retry after a failure; doubles per failure
    max_retry_delay: float = 300.0
    admin_port: int = ADMIN_PORT  # used when a pod declares no port named "admin"
    admin_connect_timeout: float = 2.0
    admin_read_timeout: float = 60.0
    s3_attempts: int = 3
    pod_concurrency: int = 64  # admin calls in flight, operator-wide

    def __post_init__(self):
        for name in ("drift_interval", "poll_interval", "retry_delay", "max_retry_delay"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Tunables.{name} must be > 0")
        if self.pod_concurrency < 1 or self.s3_attempts < 1:
            raise ValueError("Tunables.pod_concurrency and s3_attempts must be >= 1")


@dataclass(slots=True)
class Context:
    kube: Kube
    tunables: Tunables = field(default_factory=Tunables)
    admin: AdminClient | None = None
    policy: OperatorPolicy = field(default_factory=OperatorPolicy)  # what a LoRABase may ask for
    validated: OrderedDict = field(default_factory=OrderedDict)  # validation key -> VerifiedManifest
    failures: dict = field(default_factory=dict)  # (uid, generation) -> consecutive failures (backoff only)
    fingerprints: dict = field(default_factory=dict)  # base key -> what adapters care about
    s3_clients: dict = field(default_factory=dict)  # (endpoint, region, credentials hash) -> boto3 client
    snapshots: dict = field(default_factory=dict)  # PodAddress -> (taken at, task listing its adapters)
    inflight: dict = field(default_factory=dict)  # validation key -> the task fetching it
    latest: dict = field(default_factory=dict)  # API path -> the object our last status patch returned
    _events: dict = field(default_factory=dict)
    _limit: asyncio.Semaphore | None = None

    def start(self) -> None:
        self.admin = AdminClient(
            connect_timeout=self.tunables.admin_connect_timeout,
            read_timeout=self.tunables.admin_read_timeout,
        )
        self._limit = asyncio.Semaphore(self.tunables.pod_concurrency)
        self._events.clear()

    async def stop(self) -> None:
        if self.admin is not None:
            await self.admin.aclose()

    @property
    def limit(self) -> asyncio.Semaphore:
        assert self._limit is not None, "Context.start() runs at operator startup"
        return self._limit

    def remember_validation(self, key: tuple, value) -> None:
        self.validated[key] = value
        self.validated.move_to_end(key)
        while len(self.validated) > 4096:
            self.validated.popitem(last=False)

    def backoff(self, key: tuple, failed: bool) -> float:
        """The delay before the next attempt: exponential while failing, reset by a success."""
        if not failed:
            self.failures.pop(key, None)
            # +-10% so that thousands of daemons started together do not check their pods in bursts
            return self.tunables.drift_interval * random.uniform(0.9, 1.1)
        count = self.failures[key] = self.failures.get(key, 0) + 1
        return min(self.tunables.max_retry_delay, self.tunables.retry_delay * 2 ** (count - 1))

    # --- wake-ups: a daemon sleeps until its timeout or until an event concerns it -----------------
    def wake(self, key: tuple) -> None:
        self._events.setdefault(key, asyncio.Event()).set()

    async def sleep(self, key: tuple, timeout: float, stopped) -> None:
        event = self._events.setdefault(key, asyncio.Event())
        if event.is_set():
            event.clear()
            return
        woken = asyncio.ensure_future(event.wait())
        halted = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait({woken, halted}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            halted.cancel()
            event.clear()

    def forget(self, key: tuple, path: str = "") -> None:
        self._events.pop(key, None)
        self.latest.pop(path, None)

    def newest(self, path: str, body: dict) -> dict:
        """``body`` (from the watch), or what our own last status patch returned if that is newer."""
        mine = self.latest.get(path)
        if mine is None:
            return body
        theirs_rv = str(body.get("metadata", {}).get("resourceVersion", ""))
        mine_rv = str(mine.get("metadata", {}).get("resourceVersion", ""))
        if theirs_rv.isdigit() and mine_rv.isdigit() and int(mine_rv) > int(theirs_rv):
            return mine
        self.latest.pop(path, None)
        return body
