"""Cold adapter loads per request on 2 pods: random spreading against the endpoint picker's LoRA affinity.

A discrete-event simulation of an S-LoRA-style trace (Poisson arrivals, Zipf adapter popularity, uniform
prompt and output lengths) over two pods. Each pod admits up to ``max_seqs`` requests; an adapter must hold
one of the pod's ``slots`` GPU slots while its requests run (least recently used idle adapters are evicted);
a request whose adapter is not resident when it is admitted is a cold load. The router sees each pod only
through our real ``/metrics``: every ``scrape_s`` the pod's state goes through loraplane's metric collector
(``loraplane.http.metrics``), and the text is read with the endpoint picker's own extraction rules
(``tests/http/gie_picker.py``, re-implemented from GIE v1.5.0). Routers:

- ``random``: a Kubernetes Service (uniform choice);
- ``gie``: the picker's default scorers (queue 2, kv-cache 2) plus ``lora-affinity-scorer`` (weight 2),
  max score, ties at random;
- ``gie+resident``: the same, where the affinity scorer also counts adapters resident but idle as active
  (what ``vllm:lora_adapter_loaded`` tells a scorer that reads it, as llm-d's does).
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests/http/gie_picker.py: the picker's rules

from loraplane.engine.api import AdapterInfo, EngineInfo, QueueStats  # noqa: E402
from loraplane.http.metrics import Metrics  # noqa: E402
from tests.http import gie_picker  # noqa: E402

ROUTERS = ("random", "gie", "gie+resident")
WEIGHTS = {"queue": 2.0, "kv": 2.0, "lora": 2.0}


@dataclass
class Request:
    id: int
    arrival: float
    adapter: str
    prompt: int
    output: int
    start: float = 0.0


@dataclass
class Pod:
    """One server: continuous batching, a GPU adapter pool of ``slots`` adapters (LRU among idle ones)."""

    name: str
    slots: int
    max_seqs: int
    kv_tokens: int
    running: dict[int, Request] = field(default_factory=dict)
    waiting: deque = field(default_factory=deque)
    gpu: OrderedDict = field(default_factory=OrderedDict)  # adapter -> None, least recently used first
    users: dict[str, int] = field(default_factory=dict)  # adapter -> running requests
    cold: int = 0
    served: int = 0
    changed_at: float = 0.0

    def admit(self, now: float, timing) -> list[tuple[float, Request]]:
        """Start waiting requests in arrival order while there is room; (finish time, request) of each."""
        started = []
        while self.waiting and len(self.running) < self.max_seqs:
            req = self.waiting[0]
            load = 0.0
            if req.adapter not in self.gpu:
                idle = [a for a in self.gpu if not self.users.get(a)]
                if len(self.gpu) >= self.slots and not idle:
                    break  # every slot holds an adapter in use: the head waits
                if len(self.gpu) >= self.slots:
                    del self.gpu[idle[0]]
                self.gpu[req.adapter] = None
                self.cold += 1
                load = timing.load_s
            self.gpu.move_to_end(req.adapter)
            self.waiting.popleft()
            self.users[req.adapter] = self.users.get(req.adapter, 0) + 1
            self.running[req.id] = req
            req.start = now
            started.append((now + load + timing.service_s(req), req))
        self.changed_at = now
        return started

    def finish(self, req: Request, now: float) -> None:
        del self.running[req.id]
        self.users[req.adapter] -= 1
        self.served += 1
        self.changed_at = now


class PodEngine:
    """What loraplane's metric collector reads of an engine, answered from a simulated pod."""

    def __init__(self, pod: Pod) -> None:
        self.pod = pod

    def info(self) -> EngineInfo:
        return EngineInfo(
            "sim", 4096, 32000, 16, (), "sim", "bfloat16", max_loras=self.pod.slots, kv_block_size=16
        )

    def queue_stats(self) -> QueueStats:
        p = self.pod
        used = sum(r.prompt + r.output for r in p.running.values()) // 16
        return QueueStats(len(p.running), len(p.waiting), min(used, p.kv_tokens // 16), p.kv_tokens // 16,
                          frozenset(f"{r.adapter}@v1" for r in p.running.values()),
                          frozenset(f"{r.adapter}@v1" for r in p.waiting), p.changed_at)  # fmt: skip

    def adapters(self) -> list[AdapterInfo]:
        on_gpu = set(self.pod.gpu)
        names = (
            on_gpu | {r.adapter for r in self.pod.running.values()} | {r.adapter for r in self.pod.waiting}
        )
        return [AdapterInfo(n, "v1", "sha256:0", "warm", "gpu" if n in on_gpu else "host", False, True, 0, 16, 0)
                for n in sorted(names)]  # fmt: skip


@dataclass
class Timing:
    decode_s: float  # per output token
    prefill_tok_s: float  # per prompt token
    load_s: float  # one adapter host -> GPU

    def service_s(self, req: Request) -> float:
        return req.prompt * self.prefill_tok_s + req.output * self.decode_s


def trace(rng: random.Random, rate: float, seconds: float, adapters: int, alpha: float) -> list[Request]:
    """S-LoRA's synthetic workload: Poisson arrivals; adapter i drawn with weight 1 / (i + 1)^alpha."""
    weights = [1.0 / (i + 1) ** alpha for i in range(adapters)]
    names = [f"lora-{i:04d}" for i in range(adapters)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return out
        adapter = rng.choices(names, weights)[0]
        out.append(Request(len(out), t, adapter, rng.randint(8, 512), rng.randint(8, 512)))


def scores(pod_metrics: list, adapter: str, resident: list[set[str]]) -> list[float]:
    """The picker's weighted scorers (queue-scorer, kv-cache-utilization-scorer, lora-affinity-scorer)."""
    queues = [m.waiting_queue_size for m in pod_metrics]
    lo, hi = min(queues), max(queues)
    total = []
    for m, held in zip(pod_metrics, resident, strict=True):
        queue = 1.0 if hi == lo else (hi - m.waiting_queue_size) / (hi - lo)
        kv = 1.0 - m.kv_cache_usage_percent
        if held:  # gie+resident: idle resident adapters count as active
            m = gie_picker.PodMetrics(active_models={**m.active_models, **dict.fromkeys(held, 0)},
                                      waiting_models=m.waiting_models, max_active_models=m.max_active_models)  # fmt: skip
        lora = gie_picker.lora_affinity(m, adapter)
        total.append(WEIGHTS["queue"] * queue + WEIGHTS["kv"] * kv + WEIGHTS["lora"] * lora)
    return total


def scrape(metrics: list[Metrics]) -> tuple[list, list[set[str]]]:
    """Each pod's /metrics text, read as the picker reads it; plus the GPU-resident adapters it names."""
    parsed, resident = [], []
    for m in metrics:
        text = m.routing_exposition().decode()
        parsed.append(gie_picker.extract(text))
        families = gie_picker.parse(text)
        loaded = families.get("vllm:lora_adapter_loaded")
        resident.append(
            {
                s.labels["adapter_name"]
                for s in (loaded.series if loaded else [])
                if s.labels["level"] == "gpu"
            }
        )
    return parsed, resident


def simulate(router: str, requests: list[Request], args, seed: int) -> dict:
    rng = random.Random(seed)
    timing = Timing(args.decode_ms / 1000, args.prefill_us / 1e6, args.load_ms / 1000)
    pods = [Pod(f"pod-{i}", args.slots, args.max_seqs, args.kv_tokens) for i in range(args.pods)]
    metrics = []
    for pod in pods:
        m = Metrics()
        m.watch_engine(PodEngine(pod))
        metrics.append(m)
    events: list = [(r.arrival, 1, r.id, "arrive", r) for r in requests]
    heapq.heapify(events)
    seen, latest, waits = None, None, []
    done, scraped_at, period = 0, -1.0, args.scrape_ms / 1000
    while events and done < len(requests):
        now, _, _, kind, item = heapq.heappop(events)
        if kind == "arrive":
            if router != "random" and now - scraped_at >= period:
                # Scraped when a request needs it, at most once a period: never older than the picker's view.
                seen, latest = scrape(metrics)
                scraped_at = now - (now % period)
            if router == "random":
                pod = rng.choice(pods)
            else:
                held = latest if router == "gie+resident" else [set() for _ in pods]
                s = scores(seen, item.adapter, held)
                best = max(s)
                pod = rng.choice([p for p, v in zip(pods, s, strict=True) if v == best])
            pod.waiting.append(item)
        else:
            pod, req = item
            pod.finish(req, now)
            done += 1
        for finish, req in pod.admit(now, timing):
            waits.append(req.start - req.arrival)
            heapq.heappush(events, (finish, 2, req.id, "finish", (pod, req)))
    cold = sum(p.cold for p in pods)
    return {
        "router": router,
        "requests": len(requests),
        "cold_loads": cold,
        "cold_per_request": cold / len(requests),
        "mean_queue_s": statistics.fmean(waits),
        "p99_queue_s": sorted(waits)[int(0.99 * (len(waits) - 1))],
        "share_pod0": pods[0].served / max(1, sum(p.served for p in pods)),
    }


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench/run.py routing")
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--adapters", type=int, nargs="+", default=[20, 100, 500])
    parser.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second, both pods together")
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--slots", type=int, default=16, help="GPU adapter slots per pod (max_lora)")
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--kv-tokens", type=int, default=32768)
    parser.add_argument("--decode-ms", type=float, default=25.0)
    parser.add_argument("--prefill-us", type=float, default=200.0)
    parser.add_argument("--load-ms", type=float, default=100.0)
    parser.add_argument("--scrape-ms", type=float, default=50.0, help="the picker's metrics refresh interval")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    rows = []
    for adapters in args.adapters:
        for router in ROUTERS:
            runs = []
            for seed in range(args.seeds):
                requests = trace(random.Random(seed), args.rate, args.seconds, adapters, args.alpha)
                runs.append(simulate(router, requests, args, seed))
            row = {"adapters": adapters, "router": router}
            for key in (
                "requests",
                "cold_loads",
                "cold_per_request",
                "mean_queue_s",
                "p99_queue_s",
                "share_pod0",
            ):
                row[key] = statistics.fmean(r[key] for r in runs)
            row["cold_per_request_runs"] = [round(r["cold_per_request"], 4) for r in runs]
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["adapters"] == row["adapters"] and r["router"] == "random")
        row["vs_random"] = (
            row["cold_per_request"] / base["cold_per_request"] if base["cold_per_request"] else None
        )
    return {
        "title": f"Cold adapter loads per request, {args.pods} pods, random spreading vs LoRA affinity",
        "columns": [
            "adapters",
            "router",
            "requests",
            "cold_per_request",
            "vs_random",
            "mean_queue_s",
            "p99_queue_s",
            "share_pod0",
        ],  # fmt: skip
        "rows": rows,
        "meta": {k: v for k, v in vars(args).items()},
        "notes": [
            "Means over seeds; the same trace per seed for every router. cold_per_request: admissions whose adapter "
            "was not GPU-resident, per request. share_pod0: requests pod 0 served (balance).",
            "The router reads each pod only through loraplane's /metrics text (vllm:* families), parsed with the "
            "endpoint picker's extraction rules; scores: queue 2, kv-cache 2, lora-affinity 2, max score.",
        ],
    }
