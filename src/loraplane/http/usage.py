"""Token metering per tenant and adapter version: each request's prompt and completion tokens, counted when it
ends, in Prometheus counters of bounded cardinality and in the usage log (usage_log.py).

What counts: the prompt once per request, from the moment the engine accepted it (whatever happens next),
and each choice's completion tokens as the engine delivered them. A request that ran to its end is counted
exactly as the ``usage`` of its answer. A request whose client left is counted for what it generated until
then; tokens generated after the server stopped reading its stream (the steps before the abort reached the
engine) are dropped by the engine with the request, unseen and uncounted.

Cardinality of ``loraplane_tokens_total{tenant, adapter, version, type}``: a label set (a tenant's use of one
adapter version) gets its own series when first seen while fewer than ``top_n`` have one, and keeps it; the
rest fold into ``tenant="other", version="other"`` under the adapter's capped label (``Metrics.adapter_label``:
at most ``--metrics-adapter-labels`` names, then ``other``), and ``loraplane_usage_folded_series_total``
counts the label sets folded. A series never moves: use that left its own series for ``other`` would make
one of the two counters go backwards. So "the top N by use" is "the first N seen since start", and each
start ranks the label sets by their tokens in the usage log's last day and admits the heaviest first. At most
``top_n`` + adapter labels + 2 series per type. Label values come from the keys file's names and the adapter
registry only, never from a request's text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from loraplane.http.usage_log import UsageLog, UsageRecord

if TYPE_CHECKING:
    from loraplane.engine.core.llm_engine import RequestOutput

log = logging.getLogger("loraplane.http.usage")

OTHER = "other"
BASE = "base"
DEFAULT_TOP_N = 100
RANK_WINDOW_S = 24 * 3600
STATUSES = ("ok", "aborted", "error")  # in rising order: a request's status is the worst of its parts


class SeriesCap:
    """Label sets admitted to their own series, first come, at most ``limit`` of them; and the distinct ones
    folded. Both sets are bounded by (key names) x (adapter versions loaded), never by requests."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"usage_top_n: must be an integer >= 0, got {limit!r}")
        self.limit = limit
        self._own: set[tuple] = set()
        self._folded: set[tuple] = set()
        self._lock = threading.Lock()

    def admit(self, key: tuple) -> tuple[bool, bool]:
        """(own series?, folded for the first time?)."""
        with self._lock:
            if key in self._own:
                return True, False
            if len(self._own) < self.limit:
                self._own.add(key)
                return True, False
            if key in self._folded:
                return False, False
            self._folded.add(key)
            return False, True

    @property
    def own(self) -> int:
        return len(self._own)


class UsageMeter:
    """The server's meter: counters in the metrics registry, lines in the usage log (when there is one)."""

    def __init__(self, registry: CollectorRegistry, adapter_label: Callable[[str | None], str],
                 top_n: int = DEFAULT_TOP_N, usage_log: UsageLog | None = None,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.cap, self.adapter_label, self.log, self.clock = SeriesCap(top_n), adapter_label, usage_log, clock
        p = "loraplane_"
        self.tokens = Counter(p + "tokens", "Prompt and completion tokens by tenant and adapter version, counted "
                              "when each request ends", ["tenant", "adapter", "version", "type"], registry=registry)  # fmt: skip
        self.folded = Counter(p + "usage_folded_series", "Label sets (tenant, adapter, version) counted under "
                              "tenant=other because top_n had their own series", registry=registry)  # fmt: skip
        self.requests = Counter(p + "usage_requests", "Requests metered, by status (ok, aborted, error)",
                                ["status"], registry=registry)  # fmt: skip
        if usage_log is not None:
            self._rank_from_log(usage_log)

    def start(self, request_id: str, tenant: str, adapter: str | None, version: str | None,
              prompt_tokens: int) -> RequestMeter:  # fmt: skip
        return RequestMeter(self, request_id, tenant, adapter, version, prompt_tokens)

    def record(self, record: UsageRecord) -> None:
        """A request ended: its line first (durability), then the counters."""
        if self.log is not None:
            self.log.append(record)
        tenant, adapter, version = self.labels(record.tenant, record.adapter, record.version)
        self.tokens.labels(tenant, adapter, version, "prompt").inc(record.prompt_tokens)
        self.tokens.labels(tenant, adapter, version, "completion").inc(record.completion_tokens)
        self.requests.labels(record.status).inc()

    def labels(self, tenant: str, adapter: str | None, version: str | None) -> tuple[str, str, str]:
        own, newly_folded = self.cap.admit((tenant, adapter, version))
        if own:
            return tenant, adapter if adapter is not None else BASE, version or ""
        if newly_folded:
            self.folded.inc()
        return OTHER, self.adapter_label(adapter), OTHER

    def _rank_from_log(self, usage_log: UsageLog) -> None:
        """Admit the label sets that used most over the last day first (the log ranks what counters cannot)."""
        used: dict[tuple, int] = {}
        for record in usage_log.read(self.clock() - RANK_WINDOW_S):
            key = (record.tenant, record.adapter, record.version)
            used[key] = used.get(key, 0) + record.prompt_tokens + record.completion_tokens
        for key in sorted(used, key=used.__getitem__, reverse=True)[: self.cap.limit]:
            self.cap.admit(key)
        if used:
            log.info("usage series ranked from the log", extra={"fields": {"label_sets": len(used),
                     "admitted": self.cap.own}})  # fmt: skip


class RequestMeter:
    """One request's use while it runs. It is held by the route and by each choice's run while it streams;
    when the last lets go, the record is written, once: before the answer completes (the route lets go
    before the last SSE chunk, and before a whole answer is sent). A run that starts after that (a choice
    whose client left as it started) is not counted again. Event loop thread only."""

    __slots__ = (
        "_meter",
        "_id",
        "_who",
        "_prompt",
        "_completions",
        "_holds",
        "_status",
        "_route_done",
        "done",
    )

    def __init__(self, meter: UsageMeter | None, request_id: str, tenant: str, adapter: str | None,
                 version: str | None, prompt_tokens: int) -> None:  # fmt: skip
        self._meter, self._id, self._who = meter, request_id, (tenant, adapter, version)
        self._prompt, self._completions = prompt_tokens, {}
        self._holds, self._status, self._route_done, self.done = 1, "ok", False, False

    def hold(self) -> bool:
        """A choice's run starts streaming; False once the record is written (the run then never lets go)."""
        if self.done:
            return False
        self._holds += 1
        return True

    def add(self, index: int, out: RequestOutput) -> None:
        self._completions[index] = out.num_output_tokens  # counts every token so far, the stop token too

    def let_go(self, status: str) -> None:
        """A holder is done (``status``: how it ended)."""
        if STATUSES.index(status) > STATUSES.index(self._status):
            self._status = status
        self._holds -= 1
        if self._holds == 0 and not self.done:
            self.done = True
            if self._meter is not None:
                self._meter.record(UsageRecord(self._meter.clock(), *self._who, self._prompt,
                                               self.completion_tokens, self._status, self._id))  # fmt: skip

    def end_route(self, status: str) -> None:
        """The route is done with the request (idempotent: the first call says how)."""
        if not self._route_done:
            self._route_done = True
            self.let_go(status)

    @property
    def completion_tokens(self) -> int:
        return sum(self._completions.values())


def unmetered() -> RequestMeter:
    """A meter that never records (Choices built without one, in tests)."""
    return RequestMeter(None, "", "", None, None, 0)
