"""Host-side cost of the torch-free scheduler: schedule() + commit() per engine step, and prefix-cache hashing.

Runs on any CPU (no torch). The GPU step it must hide behind is the engine benchmark's decode step at batch 64
(6.62 ms on the H200, Llama-3-8B shapes): the scheduler's share of a step is reported against it.
"""

from __future__ import annotations

import random
import time

from loraplane.engine.core.block_manager import BlockManager
from loraplane.engine.core.scheduler import Scheduler
from loraplane.engine.core.sequence import SamplingParams, Sequence

DECODE_STEP_MS = 6.62  # an H200 decode step of the engine benchmark, batch 64, context 512


class Pool:
    """Residency stand-in: a fixed set of resident adapters; everything else never finishes loading."""

    def __init__(self, resident: set[str], cap: int) -> None:
        self.resident, self.max_adapters_per_step = resident, cap

    def is_ready(self, key):
        return key in self.resident

    def request(self, key):
        pass

    def acquire(self, key):
        pass

    def release(self, key):
        pass

    def digest(self, key):
        return key


def _step_cost(sched: Scheduler, steps: int) -> float:
    """Mean µs of schedule() + commit() + appending the sampled token, over `steps` steady steps."""
    spent = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        batch = sched.schedule()
        sched.commit(batch)
        for chunk in batch.chunks:
            if chunk.sample:
                chunk.seq.append_token(7)
        spent += time.perf_counter() - start
    return spent / steps * 1e6


def _scheduler(num_blocks: int, residency=None, caching: bool = False) -> Scheduler:
    bm = BlockManager(num_blocks, 16, enable_prefix_caching=caching)
    return Scheduler(bm, 256, 8192, 4096, residency=residency)


def decode_only(steps: int) -> dict:
    sched = _scheduler(256 * 40)
    for i in range(256):
        sched.add(Sequence([i % 251 + 1] * 512, SamplingParams(max_tokens=4000)))
    sched.commit(sched.schedule())
    return {"case": "256 running decodes, base only, 0 waiting", "us_per_step": _step_cost(sched, steps)}


def many_adapters_waiting(steps: int, num_waiting: int, num_adapters: int) -> dict:
    rng = random.Random(0)
    resident = {f"a{i}@1" for i in range(64)}
    sched = _scheduler(256 * 40, residency=Pool(resident, cap=64))
    for i in range(256):
        sched.add(Sequence([i % 251 + 1] * 512, SamplingParams(max_tokens=4000), adapter=f"a{i % 64}@1"))
    sched.commit(sched.schedule())
    sched.max_num_seqs = 256  # full: the waiting ones are ordered and skipped every step
    for _ in range(num_waiting):
        adapter = f"a{int(rng.random() ** 10 * num_adapters)}@1"  # numpy.random.power(0.1) popularity
        sched.add(Sequence([3] * 64, SamplingParams(max_tokens=16), adapter=adapter))
    return {
        "case": f"256 running + {num_waiting} waiting over {num_adapters} adapters (64 resident, cap 64)",
        "us_per_step": _step_cost(sched, steps),
    }


def prefix_admission(num_requests: int) -> dict:
    """Admitting 2,048-token prompts that share a 1,024-token system prompt: hashing its 128 blocks, looking
    them up and claiming the 64 cached ones, per request (the cost prefix caching adds to admission)."""
    system = [random.Random(1).randrange(32000) for _ in range(1024)]
    bm = BlockManager(4096, 16, enable_prefix_caching=True)
    first = Sequence(system + [5] * 1024, SamplingParams(max_tokens=1))
    bm.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.cache_full_blocks(first)
    seqs = [Sequence(system + [i] * 1024, SamplingParams(max_tokens=1)) for i in range(num_requests)]
    start = time.perf_counter()
    for seq in seqs:
        hits = bm.lookup(seq)
        bm.claim(seq, hits)
        bm.free(seq)
    spent = time.perf_counter() - start
    return {
        "case": "admit a 2048-token prompt sharing 1024 tokens with a cached one (prefix caching on)",
        "us_per_request": spent / num_requests * 1e6,
        "hit_tokens_mean": bm.prefix_hit_tokens // num_requests,
    }


def run(argv: list[str]) -> dict:
    steps = 200
    rows = [
        decode_only(steps),
        many_adapters_waiting(steps, 1000, 1000),
        many_adapters_waiting(steps, 4000, 1000),
        prefix_admission(200),
    ]
    for row in rows:
        cost = row.get("us_per_step", row.get("us_per_request"))
        row["share_of_decode_step"] = cost / (DECODE_STEP_MS * 1000)
    return {
        "title": "Scheduler host cost per engine step (CPU, torch-free)",
        "columns": ["case", "us_per_step", "share_of_decode_step", "us_per_request", "hit_tokens_mean"],
        "rows": rows,
        "meta": {"decode_step_ms_h200": DECODE_STEP_MS, "steps_averaged": steps},
        "notes": [],
    }
