"""Prometheus metrics (prefix ``loraplane_``), served on the admin port at ``GET /metrics``.

One registry per server (not the process-global one), so several servers in one process stay apart.
Cardinality: the ``adapter`` label appears only on the per-request counters and holds at most
``max_adapter_labels`` distinct names (the first ones seen since start); later names count as ``other``.
Tiers, phases, statuses and verification reasons are closed sets. Everything about every adapter is in
``GET /admin/adapters`` instead.

Beside our own metrics, the families routers read, in vLLM's names (the Gateway API Inference Extension's
model-server protocol, and the per-adapter residency gauges llm-d's scorer reads): see ``_RoutingCollector``.
They are also served alone (``routing_exposition``) where a router scrapes without the admin token.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplane.engine.api import StepStats

LEVELS = {"gpu": "gpu", "host": "cpu"}  # our tier -> the residency level routers know (disk: not loaded)

BASE_LABEL = "base"
OTHER_LABEL = "other"
TIERS = ("gpu", "host", "disk", "remote")
PHASES = ("download", "verify", "load", "warm")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180)
STEP_ADAPTER_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class AdapterLabels:
    """Name -> label value, for at most ``limit`` distinct names; the rest share ``other``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str | None) -> str:
        if name is None:
            return BASE_LABEL
        with self._lock:
            if name in self._seen:
                return name
            if len(self._seen) < self.limit:
                self._seen.add(name)
                return name
        return OTHER_LABEL


class Metrics:
    def __init__(self, max_adapter_labels: int = 100) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.adapter_label = AdapterLabels(max_adapter_labels)
        p = "loraplane_"
        # --- requests
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token, by the adapter's tier "
                              "at arrival", ["tier"], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between two output tokens",
                             buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram(p + "request_duration_seconds", "Arrival to last token (or error)", ["endpoint"],
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.requests = Counter(p + "requests", "Requests answered, by HTTP status", ["endpoint", "status",
                                "adapter"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", ["adapter"], registry=r)
        self.output_tokens = Counter(p + "generation_tokens", "Tokens generated", ["adapter"], registry=r)
        self.aborted = Counter(p + "requests_aborted", "Requests stopped before their end (client left, "
                               "overload, error)", ["cause"], registry=r)  # fmt: skip
        self.waiting = Gauge(
            p + "requests_waiting", "Admitted requests without a first token yet", registry=r
        )
        self.running = Gauge(p + "requests_running", "Requests producing tokens", registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests refused before the engine (429)", ["cause"],
                                registry=r)  # fmt: skip
        # --- adapters
        self.loads = Counter(p + "adapter_loads", "Adapter versions loaded into the engine", registry=r)
        self.unloads = Counter(p + "adapter_unloads", "Adapter versions unloaded", registry=r)
        self.cold_starts = Counter(p + "adapter_cold_starts", "Requests whose adapter was not on the GPU at "
                                   "arrival", ["tier"], registry=r)  # fmt: skip
        self.phase = Histogram(p + "adapter_phase_seconds", "Time of each phase of an adapter load",
                               ["phase"], buckets=PHASE_BUCKETS, registry=r)  # fmt: skip
        self.load_failures = Counter(p + "adapter_load_failures", "Adapter loads refused or failed, by reason",
                                     ["reason"], registry=r)  # fmt: skip
        self.verify_failures = Counter(p + "adapter_verification_failures", "Adapter artifacts refused by "
                                       "verification, by reason", ["reason"], registry=r)  # fmt: skip
        # --- steps
        self.step_adapters = Histogram(p + "step_adapters", "Distinct adapters in one engine step",
                                       buckets=STEP_ADAPTER_BUCKETS, registry=r)  # fmt: skip
        self.kv_used = Gauge(p + "kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "KV cache blocks", registry=r)
        self.pool_used = Gauge(p + "adapter_pool_bytes_used", "GPU adapter pool bytes in use", registry=r)
        self.pool_total = Gauge(p + "adapter_pool_bytes_budget", "GPU adapter pool bytes", registry=r)
        # Unified memory only: no samples in split mode, where the two pools above are fixed.
        self.gpu_memory = Gauge(p + "gpu_memory_bytes", "Unified GPU memory pool bytes, by use (kv, adapters, "
                                "free)", ["use"], registry=r)  # fmt: skip
        # --- routers (vLLM's names): also in routing_registry, the set a router may scrape without the token
        self.routing_registry = CollectorRegistry(auto_describe=True)
        self.lora_load = Histogram("vllm:lora_adapter_load_seconds", "Time to load an adapter version into the "
                                   "engine (parse and validate)", buckets=PHASE_BUCKETS, registry=r)  # fmt: skip
        self.routing_registry.register(self.lora_load)

    def observe_phase(self, phase: str, seconds: float) -> None:
        """One phase of an adapter load (PHASES); the engine load also feeds the routers' load histogram."""
        self.phase.labels(phase).observe(seconds)
        if phase == "load":
            self.lora_load.observe(seconds)

    def on_step(self, stats: StepStats) -> None:
        """An engine step listener (runs on the engine thread; prometheus_client is thread-safe)."""
        self.step_adapters.observe(stats.num_adapters)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.pool_used.set(stats.adapter_bytes_gpu)
        self.pool_total.set(stats.adapter_bytes_budget)
        for use, size in (stats.gpu_memory_bytes or {}).items():
            self.gpu_memory.labels(use).set(size)

    def watch_engine(self, engine, host_cache=None) -> None:
        """Gauges read at scrape time: adapters and bytes per tier, host cache use and evictions, and the
        queues and residency routers read."""
        self.registry.register(_TierCollector(engine, host_cache))
        routing = _RoutingCollector(engine)
        self.registry.register(routing)
        self.routing_registry.register(routing)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def routing_exposition(self) -> bytes:
        """Only the routers' families (no per-request counters, no adapter lifecycle detail)."""
        return generate_latest(self.routing_registry)


class _TierCollector:
    def __init__(self, engine, host_cache) -> None:
        self.engine, self.host_cache = engine, host_cache

    def describe(self):
        return []

    def collect(self):
        count = GaugeMetricFamily("loraplane_adapters", "Adapter versions held, by tier", labels=["tier"])
        size = GaugeMetricFamily(
            "loraplane_adapter_bytes", "Adapter weight bytes held, by tier", labels=["tier"]
        )
        per_tier = {tier: [0, 0] for tier in TIERS}
        for info in self.engine.adapters():
            slot = per_tier.setdefault(info.tier, [0, 0])
            slot[0] += 1
            slot[1] += info.bytes
        if self.host_cache is not None:
            stats = self.host_cache.stats()
            used = GaugeMetricFamily("loraplane_host_cache_bytes", "Verified adapter files in the host cache")
            used.add_metric([], stats["used_bytes"])
            evictions = CounterMetricFamily(
                "loraplane_adapter_evictions", "Adapters evicted from the host cache (LRU or corrupt)"
            )
            evictions.add_metric([], stats["evictions"] + stats["corrupt_evictions"])
            yield used
            yield evictions
        for tier, (n, b) in per_tier.items():
            count.add_metric([tier], n)
            size.add_metric([tier], b)
        yield count
        yield size


class _RoutingCollector:
    """What the endpoint picker of the Gateway API Inference Extension scrapes, in the names it defaults to.

    Protocol: queue length, running requests, KV use as a fraction, and ``vllm:lora_requests_info`` whose
    value is the time its labels last changed (the picker keeps the series with the largest value) and whose
    labels name the adapters of running and waiting requests, comma-joined, and ``max_lora``, the adapters
    the GPU holds at once. That metric misses adapters resident but idle, so ``vllm:lora_adapter_loaded``
    (1 per serving version on the GPU or in host RAM) and the slot gauges say where each adapter sits.
    Label values are adapter names from the engine's registry only (names cannot hold commas), never a
    request's own text; a name appears once, through its serving version.
    """

    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        info, queues, adapters = self.engine.info(), self.engine.queue_stats(), self.engine.adapters()
        names = {a.key: a.name for a in adapters}  # the registry: the only source of label values
        yield _gauge("vllm:num_requests_running", "Requests scheduled in the engine", queues.num_running)
        yield _gauge("vllm:num_requests_waiting", "Requests queued in the engine", queues.num_waiting)
        used = queues.kv_blocks_used / queues.kv_blocks_total if queues.kv_blocks_total else 0.0
        yield _gauge("vllm:kv_cache_usage_perc", "KV cache blocks in use, as a fraction (0 to 1)", used)
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Adapters of running and waiting requests; the "
                                 "value is when they last changed (unix seconds)",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])  # fmt: skip
        running = ",".join(sorted({names[k] for k in queues.running_adapters if k in names}))
        waiting = ",".join(sorted({names[k] for k in queues.waiting_adapters if k in names}))
        lora.add_metric([str(info.max_loras), running, waiting], queues.updated_at)
        yield lora
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "KV cache layout", labels=["block_size", "num_gpu_blocks"]
        )
        cache.add_metric([str(info.kv_block_size), str(queues.kv_blocks_total)], 1)
        yield cache
        yield from _residency(adapters, info.max_loras)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _residency(adapters, max_loras: int):
    loaded = GaugeMetricFamily("vllm:lora_adapter_loaded", "1 while the adapter's serving version is loaded, "
                               "by level (gpu, cpu)", labels=["adapter_name", "level", "pinned", "rank"])  # fmt: skip
    for a in sorted(adapters, key=lambda a: a.name):
        if a.serving and a.tier in LEVELS:
            loaded.add_metric([a.name, LEVELS[a.tier], str(a.pinned).lower(), str(a.rank)], 1)
    yield loaded
    on_gpu = sum(1 for a in adapters if a.tier == "gpu")  # every version takes a slot, serving or not
    yield _gauge("vllm:num_gpu_loaded_lora_adapters", "Adapter versions resident on the GPU", on_gpu)
    yield _gauge(
        "vllm:max_gpu_lora_adapters", "Adapters the GPU holds at once (at the largest rank)", max_loras
    )
