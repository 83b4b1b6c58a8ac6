"""Clients that stream chat completions without pause, over the OpenAI API, spread over the adapters and the
base, each request sent to one ready server Pod in turn (what a Service does). A request that fails is retried
once on another ready Pod, as a user behind a Service would; each answer's adapter version is read from the
`X-Loraplane-Adapter-Version` header and checked against the version ledger.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass, field

from e2e.soak.world import BASE, is_ready
from loraplane.http.openai_api import VERSION_HEADER

MESSAGES = [{"role": "user", "content": "hello there"}]
MAX_TOKENS = 6
REQUEST_TIMEOUT = 60.0
KEEP_FAILURES = 200  # the report keeps the first failures of each kind in full


class Endpoints:
    """The ready server Pods (name, IP), refreshed from the API twice a second: a Service's endpoints."""

    def __init__(self, stack, origin: float = 0.0):
        self.stack, self.origin = stack, origin
        self.first_ready: dict[str, float] = {}  # pod name -> when it first joined (seconds since origin)
        self._pods: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._turn = itertools.count()

    def refresh(self) -> None:
        pods = [(p["metadata"]["name"], p["status"]["podIP"]) for p in self.stack.server_pods(BASE)
                if is_ready(p) and p["status"].get("podIP")]  # fmt: skip
        with self._lock:
            self._pods = sorted(pods)
            for name, _ in pods:
                self.first_ready.setdefault(name, round(time.monotonic() - self.origin, 2))

    def pick(self, avoid: str | None = None) -> tuple[str, str] | None:
        with self._lock:
            pods = [p for p in self._pods if p[0] != avoid] or list(self._pods)
        return pods[next(self._turn) % len(pods)] if pods else None


@dataclass
class Ledger:
    """Every version applied to each adapter (monotonic time, version), and when each was seen Ready everywhere.

    An answer is right when its version is the one current when the request started, or the one before it
    while the switch to the current one has not finished (the adapter not yet seen Ready on it).
    """

    applied: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    ready_at: dict[tuple[str, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, name: str, version: str, at: float) -> None:
        with self._lock:
            self.applied.setdefault(name, []).append((at, version))

    def retract(self, name: str, version: str) -> None:
        """A version whose spec change failed never became current."""
        with self._lock:
            self.applied[name] = [(t, v) for t, v in self.applied[name] if v != version]

    def mark_ready(self, name: str, version: str, at: float) -> None:
        with self._lock:
            self.ready_at.setdefault((name, version), at)

    def current(self, name: str) -> str:
        with self._lock:
            return self.applied[name][-1][1]

    def allowed(self, name: str, started: float) -> set[str]:
        with self._lock:
            history = [v for t, v in self.applied[name] if t <= started] or [self.applied[name][0][1]]
            now_version = history[-1]
            allowed = {now_version}
            switching = self.ready_at.get((name, now_version), float("inf")) >= started
            if len(history) > 1 and switching:
                allowed.add(history[-2])
            return allowed


@dataclass
class Tally:
    """What the clients saw, in 10-second buckets plus the failures themselves."""

    origin: float
    bucket_s: float = 10.0
    requests: dict[int, int] = field(default_factory=dict)
    first_failures: dict[int, int] = field(default_factory=dict)
    failed: list[dict] = field(default_factory=list)  # both attempts failed
    retried: list[dict] = field(default_factory=list)  # the first attempt failed, the retry succeeded
    wrong_version: list[dict] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"requests": 0, "answers": 0, "retried": 0,
                                                            "failed": 0, "wrong_version": 0})  # fmt: skip
    by_model: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def bucket(self, t: float) -> int:
        return int((t - self.origin) // self.bucket_s)

    def record(self, kind: str, started: float, detail: dict | None = None) -> None:
        with self._lock:
            b = self.bucket(started)
            if kind == "request":
                self.counts["requests"] += 1
                self.requests[b] = self.requests.get(b, 0) + 1
                model = (detail or {}).get("model", "?")
                self.by_model[model] = self.by_model.get(model, 0) + 1
                return
            if kind == "first_failure":
                self.first_failures[b] = self.first_failures.get(b, 0) + 1
                return
            self.counts[kind] += 1
            keep = {"failed": self.failed, "retried": self.retried, "wrong_version": self.wrong_version}.get(
                kind
            )
            # every retry is kept (the verdict attributes each to a kill); failures of other kinds up to a cap
            if keep is not None and detail is not None and (kind == "retried" or len(keep) < KEEP_FAILURES):
                keep.append(detail)


class Clients:
    """``count`` threads, each streaming one request after another until stopped."""

    def __init__(self, endpoints: Endpoints, ledger: Ledger, tally: Tally, adapters: list[str], base_model: str,
                 count: int, seed: int = 0):  # fmt: skip
        self.endpoints, self.ledger, self.tally = endpoints, ledger, tally
        self.models = [*adapters, base_model]
        self.base_model = base_model
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(seed + i,), name=f"soak-client-{i}", daemon=True)
                        for i in range(count)]  # fmt: skip
        self._clients: dict[str, object] = {}

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self, timeout: float = 2 * REQUEST_TIMEOUT) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout)

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        clients: dict[str, object] = {}  # pod IP -> an OpenAI client (its own connection pool)
        while not self.stop.is_set():
            self.one_request(rng.choice(self.models), clients)

    def one_request(self, model: str, clients: dict) -> None:
        started = time.monotonic()
        self.tally.record("request", started, {"model": model})
        first = self._attempt(model, clients, avoid=None)
        if first["ok"]:
            return self._check(model, started, first)
        self.tally.record("first_failure", started)
        time.sleep(0.2)  # a client's reconnect; the endpoints drop a dead Pod within a second or two
        self.endpoints.refresh()
        retry = self._attempt(model, clients, avoid=first.get("pod"))
        detail = {"t": round(started - self.tally.origin, 2), "model": model, "first": first, "retry": retry}
        if not retry["ok"]:
            return self.tally.record("failed", started, detail)
        self.tally.record("retried", started, detail)
        self._check(model, started, retry)

    def _check(self, model: str, started: float, answer: dict) -> None:
        self.tally.record("answers", started)
        if model == self.base_model:
            if answer["version"] is not None:
                self.tally.record("wrong_version", started, {"model": model, **answer})
            return
        allowed = self.ledger.allowed(model, started)
        if answer["version"] not in allowed:
            detail = {"t": round(started - self.tally.origin, 2), "model": model, "allowed": sorted(allowed),
                      **answer}  # fmt: skip
            self.tally.record("wrong_version", started, detail)

    def _attempt(self, model: str, clients: dict, avoid: str | None) -> dict:
        from openai import OpenAI

        picked = self.endpoints.pick(avoid)
        if picked is None:
            return {
                "ok": False,
                "pod": None,
                "error": "no ready Pod",
                "at": time.monotonic() - self.tally.origin,
            }
        pod, ip = picked
        client = clients.get(ip)
        if client is None:
            client = clients[ip] = OpenAI(base_url=f"http://{ip}:8000/v1", api_key="none",
                                          timeout=REQUEST_TIMEOUT, max_retries=0)  # fmt: skip
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
            return {"ok": True, "pod": pod, "version": raw.headers.get(VERSION_HEADER), "chars": len(text)}
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            at = round(time.monotonic() - self.tally.origin, 2)
            return {"ok": False, "pod": pod, "error": f"{type(exc).__name__}: {exc}"[:300], "at": at}
