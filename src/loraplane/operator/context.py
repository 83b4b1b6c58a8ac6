"""What every handler shares: clients, tunables, wake-up events, and the caches of src/loraplane/operator/caches.py.

Nothing here is a source of truth: state lives in the API (specs, status) and in the pods
(GET /admin/adapters); the caches only save work and are rebuilt after a restart.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from loraplane.operator.admin_client import AdminClient
from loraplane.operator.builders import ADMIN_PORT
from loraplane.operator.caches import (
    FULL_PASS_EVERY,
    Backoff,
    Fingerprints,
    Memo,
    Quiet,
    SharedResults,
    Snapshots,
    StatusEcho,
)
from loraplane.operator.kube import Kube
from loraplane.operator.policy import OperatorPolicy

DEFAULT_DRIFT_INTERVAL = 30.0


@dataclass(slots=True)
class Tunables:
    drift_interval: float = (
        DEFAULT_DRIFT_INTERVAL  # seconds between drift checks of a converged adapter or base
    )
    # seconds after which a settled adapter's drift check makes a full pass again (Secrets, trusted keys, policy)
    full_pass_interval: float = FULL_PASS_EVERY
    poll_interval: float = 2.0  # while a pod is still pulling or warming
    retry_delay: float = 5.0  # first retry after a failure; doubles per failure
    max_retry_delay: float = 300.0
    admin_port: int = ADMIN_PORT  # used when a pod declares no port named "admin"
    admin_connect_timeout: float = 2.0
    admin_read_timeout: float = 60.0
    s3_attempts: int = 3
    pod_concurrency: int = 64  # admin calls in flight, operator-wide
    # connections open to one pod at once: a new pod's burst of loads reuses a few instead of opening one
    # per adapter (each an allocation burst of buffers and parser state on the operator's side)
    pod_connections: int = 8
    gate_timeout: float = 600.0  # seconds a pod's readiness gate waits for its adapters (readiness_gate.py)

    def __post_init__(self):
        for name in (
            "drift_interval",
            "full_pass_interval",
            "poll_interval",
            "retry_delay",
            "max_retry_delay",
            "gate_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"Tunables.{name} must be > 0")
        if min(self.pod_concurrency, self.pod_connections, self.s3_attempts) < 1:
            raise ValueError("Tunables.pod_concurrency, pod_connections and s3_attempts must be >= 1")


@dataclass(slots=True)
class Context:
    kube: Kube
    tunables: Tunables = field(default_factory=Tunables)
    admin: AdminClient | None = None
    policy: OperatorPolicy = field(default_factory=OperatorPolicy)  # what a LoRABase may ask for
    routing: bool = False  # write the Gateway API Inference Extension's objects where its CRDs are served
    validations: SharedResults = field(default_factory=SharedResults)  # key -> VerifiedManifest
    s3_clients: Memo = field(default_factory=Memo)  # (endpoint, region, credentials hash) -> boto3 client
    snapshots: Snapshots = field(default_factory=Snapshots)  # PodAddress -> its adapter listing
    fingerprints: Fingerprints = field(default_factory=Fingerprints)  # base key -> what adapters care about
    pod_prints: Fingerprints = field(default_factory=Fingerprints)  # (namespace, pod) -> its PodInfo
    echo: StatusEcho = field(default_factory=StatusEcho)  # API path -> our last status patch's answer
    failures: Backoff = field(default_factory=Backoff)  # (uid, generation) or (key, "error") -> failures
    quiet: Quiet = field(default_factory=Quiet)  # API path -> what an adapter's last settled pass saw
    _events: dict = field(default_factory=dict)
    _limit: asyncio.Semaphore | None = None

    def __post_init__(self):
        self.quiet.full_every = self.tunables.full_pass_interval

    def start(self) -> None:
        self.admin = AdminClient(
            connect_timeout=self.tunables.admin_connect_timeout,
            read_timeout=self.tunables.admin_read_timeout,
            connections=self.tunables.pod_concurrency + 8,  # and the readiness gates' listings
            per_pod=self.tunables.pod_connections,
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

    def backoff(self, key: tuple, failed: bool) -> float:
        """The delay before the next attempt: exponential while failing, reset by a success."""
        t = self.tunables
        return self.failures.delay(key, failed, steady=t.drift_interval, first=t.retry_delay,
                                   longest=t.max_retry_delay)  # fmt: skip

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
        self.echo.forget(path)
        self.quiet.forget(path)
