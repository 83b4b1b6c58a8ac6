"""What the S-LoRA trace could reach: the churn benchmark's trace through the engine's own scheduler on a
simulated clock, with step times from a model of bytes moved, so the measured throughput can be read against
a floor, and the gap split into kernels and adapter loads.

The step model (H200 constants measured by bench/lora_decode and bench/churn, overridable):

- base step = the weights' time (the measured B=64 decode step less its KV reads) + every chunk's context KV
  read once at the copy bandwidth + prefill tokens x the measured prefill time a token + the serving loop's
  own time a step (sampling, outputs; fitted to the base trace's inter-token time);
- LoRA = each distinct adapter of the step read once (rank x the all-module row bytes) at the copy bandwidth,
  plus, for the kernels as measured, a fixed time a step (the decode LoRA kernels' latency, which the
  distinct-adapter sweep of bench/lora_decode shows to be about the same for 2 and for 64 adapters) and a
  share of the prefill time.

Variants per alpha, each on the same trace: the base engine; LoRA at the byte floor with every adapter
resident; LoRA with the kernels as measured, resident; and that again with a GPU pool of the run's size
whose misses load in a given time, a bounded number at once (``SimPool``). What the measured trace loses
beyond the third is adapter churn and whatever the model leaves out. The scheduler is the engine's
(chunked prefill, adapter-aware admission, aging), so only the clock and the step times are simulated.

    python bench/churn/trace_floor.py --out DIR [--requests 100] [--rate 16] [--alphas 1 0.1]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

from loraplane.engine.core.block_manager import BlockManager
from loraplane.engine.core.scheduler import ScheduledBatch, Scheduler
from loraplane.engine.core.sequence import SamplingParams, Sequence
from loraplane.engine.lora.residency import NullResidency

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("lora_bench", HERE.parent / "lora" / "main.py")
lora_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lora_bench)  # the S-LoRA trace generator, as bench/churn/main.py uses it

RANKS = (8, 16, 32, 64)  # adapter i has rank RANKS[i % 4], as in bench/churn/main.py
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 32, 8, 128, 4096, 14336  # Llama-3-8B
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16: 128 KiB
# A rank-row of one adapter on every module (q, k, v, o, gate, up, down), every layer, bf16: in + out widths.
LORA_ROW_BYTES = LAYERS * 2 * (6 * HIDDEN + 2 * KV_HEADS * HEAD_DIM + 3 * (HIDDEN + INTER))  # 81,920 x 64


@dataclasses.dataclass(slots=True, frozen=True)
class StepModel:
    """Milliseconds of one engine step from what it reads (defaults: H200, bench/results/lora-decode.json run 6)."""

    bandwidth: float = 4.05e12  # B/s, the 1 GiB device copy (read + write counted)
    decode_ms_b64: float = 6.242  # the base B=64 step at context 512
    prefill_ms_2048: float = 48.86  # the base prefill of 8 x 256 tokens
    loop_ms: float = (
        1.4  # the serving loop's time a step beyond the forward (base trace: 6.98 ms inter-token)
    )
    lora_fixed_ms: float = (
        0.0  # the LoRA kernels' time a decode step beyond their bytes (measured: about 2.7)
    )
    lora_prefill_share: float = 0.0  # LoRA's share added to a prefill (measured: 0.16 at T=2048, 8 adapters)

    def __post_init__(self) -> None:
        for name in ("bandwidth", "decode_ms_b64", "prefill_ms_2048"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("loop_ms", "lora_fixed_ms", "lora_prefill_share"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")

    @property
    def weights_ms(self) -> float:
        return self.decode_ms_b64 - self.kv_ms(64 * 512)

    @property
    def prefill_ms_per_token(self) -> float:
        return (self.prefill_ms_2048 - self.weights_ms - self.kv_ms(8 * 256)) / 2048

    def kv_ms(self, tokens: int) -> float:
        return tokens * KV_BYTES_PER_TOKEN / self.bandwidth * 1e3

    def base_ms(self, batch: ScheduledBatch) -> float:
        context = sum(c.start + c.num_tokens for c in batch.chunks)
        prefill = sum(c.num_tokens for c in batch.chunks if c.num_tokens > 1)
        return self.loop_ms + self.weights_ms + self.kv_ms(context) + prefill * self.prefill_ms_per_token

    def lora_ms(self, batch: ScheduledBatch) -> float:
        if not batch.adapters:
            return 0.0
        rows = sum(rank_of(key) for key in batch.adapters)
        prefill = sum(c.num_tokens for c in batch.chunks if c.num_tokens > 1 and c.seq.adapter)
        return (rows * LORA_ROW_BYTES / self.bandwidth * 1e3 + self.lora_fixed_ms
                + self.lora_prefill_share * prefill * self.prefill_ms_per_token)  # fmt: skip


def rank_of(key: str) -> int:
    """ "s17@v1" -> RANKS[17 % 4]."""
    return RANKS[int(key[1:].split("@")[0]) % len(RANKS)]


class SimPool:
    """A GPU pool of ``capacity`` bytes on the simulated clock: a miss loads in ``load_s(key)`` seconds, at most
    ``in_flight`` at once; a landed adapter evicts the least recently used ones nobody holds, or waits."""

    max_adapters_per_step = 1 << 30

    def __init__(self, capacity: float, load_s, in_flight: int, clock) -> None:
        self.capacity, self.load_s, self.in_flight, self.clock = capacity, load_s, in_flight, clock
        self.resident: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self.loading: dict[str, float] = {}  # key -> when it lands
        self.held: dict[str, int] = {}
        self.loads = 0

    def is_ready(self, key: str) -> bool:
        return key in self.resident

    def request(self, key: str) -> None:
        if key not in self.resident and key not in self.loading and len(self.loading) < self.in_flight:
            self.loading[key] = self.clock() + self.load_s(key)
            self.loads += 1

    def acquire(self, key: str) -> None:
        self.held[key] = self.held.get(key, 0) + 1
        self.resident.move_to_end(key)

    def release(self, key: str) -> None:
        self.held[key] -= 1

    def digest(self, key: str) -> str:
        raise KeyError(key)

    def next_landing(self) -> float | None:
        return min(self.loading.values(), default=None)

    def tick(self) -> bool:
        """Land the loads that are due and fit; True when one landed."""
        landed = False
        for key, when in sorted(self.loading.items(), key=lambda kv: kv[1]):
            if when <= self.clock() and self._make_room(rank_of(key) * LORA_ROW_BYTES):
                del self.loading[key]
                self.resident[key] = rank_of(key) * LORA_ROW_BYTES
                landed = True
        return landed

    def _make_room(self, size: int) -> bool:
        while sum(self.resident.values()) + size > self.capacity:
            idle = next((k for k in self.resident if not self.held.get(k)), None)
            if idle is None:
                return False
            del self.resident[idle]
        return True


def simulate(trace, adapters: list[str | None], model: StepModel, lora: bool, pool=None) -> dict:
    """The trace through the engine's scheduler; each step advances the clock by the model's step time."""
    arrivals, prompts, lens_out = trace
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    residency = pool(clock) if pool else NullResidency()
    sched = Scheduler(BlockManager(1 << 16, 16, watermark=0.0), 128, 8192, 2048, residency=residency,
                      adapter_load_timeout_s=1e9, clock=clock)  # fmt: skip
    first, last, itl, ends, tokens, steps = {}, {}, [], [], 0, []
    arrived = 0
    while arrived < len(prompts) or sched.has_unfinished():
        while arrived < len(prompts) and arrivals[arrived] <= now[0]:
            params = SamplingParams(temperature=0.0, max_tokens=int(lens_out[arrived]), ignore_eos=True)
            sched.add(Sequence(prompts[arrived], params, request_id=str(arrived), adapter=adapters[arrived]))
            arrived += 1
        batch = sched.schedule()
        if not batch.chunks:  # idle, or every waiting request waits for a load
            if pool and residency.tick():  # a load that was due has landed: schedule again
                continue
            arrival = float(arrivals[arrived]) if arrived < len(prompts) else None
            events = [t for t in (arrival, residency.next_landing() if pool else None) if t is not None]
            if not events or min(events) <= now[0]:
                raise RuntimeError("the simulated engine stalled with requests left")
            now[0] = min(events)  # jump to what comes next
            continue
        step_s = (model.base_ms(batch) + (model.lora_ms(batch) if lora else 0.0)) / 1e3
        now[0] += step_s
        steps.append((step_s, len(batch.adapters)))
        sched.commit(batch)
        for chunk in batch.chunks:
            if not chunk.sample:
                continue
            seq, i = chunk.seq, int(chunk.seq.request_id)
            seq.append_token(1)
            tokens += 1
            if i not in first:
                first[i] = now[0] - float(arrivals[i])
            else:
                itl.append(now[0] - last[i])
            last[i] = now[0]
            if seq.num_output_tokens >= seq.sampling.max_tokens:
                sched.finish(seq, "length")
                ends.append(now[0])
        if pool:
            residency.tick()
    span = max(ends) - float(arrivals[0])
    ttft = np.array(list(first.values())) * 1e3
    return {"tok_s": tokens / span, "seconds": span, "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)), "itl_p50_ms": float(np.percentile(itl, 50)) * 1e3,
            "steps": len(steps), "step_ms_p50": float(np.percentile([t for t, _ in steps], 50)) * 1e3,
            "step_ms_p99": float(np.percentile([t for t, _ in steps], 99)) * 1e3,
            "distinct_per_step_mean": float(np.mean([d for _, d in steps])),
            "loads": residency.loads if pool else 0}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/churn/trace_floor.py")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--alphas", type=float, nargs="*", default=[1.0, 0.1])
    p.add_argument(
        "--lora-fixed-ms",
        type=float,
        default=2.7,
        help="the LoRA kernels' time a decode step beyond their bytes (H200 run 6, 2 to 64 distinct)",
    )
    p.add_argument("--lora-prefill-share", type=float, default=0.16,
                   help="LoRA's share added to a prefill (H200 run 6, T=2048, 8 distinct: 1.16x)")  # fmt: skip
    p.add_argument("--pool-gb", type=float, default=8.59, help="the GPU pool (the run's p8: 8.59 GB)")
    p.add_argument("--load-ms", type=float, default=180.0,
                   help="one load from disk (run 10 p50 read + hash + stack: 72 + 80 + 29 ms)")  # fmt: skip
    p.add_argument("--in-flight", type=int, default=6)
    return p


def run(args: argparse.Namespace) -> dict:
    trace = lora_bench.make_trace(args.requests, args.rate, max_len=512)
    floor = StepModel()
    measured = StepModel(lora_fixed_ms=args.lora_fixed_ms, lora_prefill_share=args.lora_prefill_share)
    base = simulate(trace, [None] * args.requests, floor, lora=False)
    rows = [{"case": "base engine", "alpha": None, **base, "x_base": 1.0}]
    for alpha in args.alphas:
        adapters = [f"s{i}@v1" for i in lora_bench.make_assignment(args.adapters, args.requests, alpha)]
        pool = lambda clock: SimPool(
            args.pool_gb * 1e9, lambda key: args.load_ms / 1e3, args.in_flight, clock
        )  # noqa: E731
        for case, model, with_pool in (("LoRA at the byte floor, all resident", floor, None),
                                       ("LoRA kernels as measured, all resident", measured, None),
                                       (f"LoRA kernels as measured, {args.pool_gb} GB pool, "
                                        f"{args.load_ms:.0f} ms loads", measured, pool)):  # fmt: skip
            r = simulate(trace, adapters, model, lora=True, pool=with_pool)
            rows.append({"case": case, "alpha": alpha, **r, "x_base": r["tok_s"] / base["tok_s"]})
    return {"title": "S-LoRA trace on a simulated clock: the engine's scheduler, step times from bytes moved",
            "rows": rows, "meta": {"requests": args.requests, "rate": args.rate, "adapters": args.adapters,
                                   "step model (floor)": dataclasses.asdict(floor),
                                   "step model (measured kernels)": dataclasses.asdict(measured),
                                   "lora row bytes (all modules, 32 layers)": LORA_ROW_BYTES}}  # fmt: skip


def write(out: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trace-floor.json").write_text(json.dumps(out, indent=1))
    cols = ["case", "alpha", "tok_s", "x_base", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "steps", "step_ms_p50",
            "step_ms_p99", "distinct_per_step_mean", "loads"]  # fmt: skip
    lines = [f"## {out['title']}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in out["rows"]:
        cells = [f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    (folder / "trace-floor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    cli = parser().parse_args(sys.argv[1:])
    write(run(cli), cli.out)
