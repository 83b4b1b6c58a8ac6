"""Adapter churn on one GPU: time to first token by tier, and the S-LoRA workload with disk loads, through the
real serving loop (AsyncEngine), against the base-only engine on the same trace.

1. Floors: the disk's read bandwidth (O_DIRECT, past the page cache), the page cache's, and host-to-device
   bandwidth from pinned memory, each measured in this run.
2. TTFT by tier (256-token prompt, r16 all-module adapter, 84 MB on the Llama-3-8B shape): adapter on the GPU,
   in pinned host RAM, only on disk; on an idle engine and under a full decode batch of other tenants
   (resident adapters). Floor = base TTFT + bytes / disk bandwidth (disk) + bytes / PCIe bandwidth (disk,
   host) [+ one decode step when loaded]. The disk is really read: the page cache is dropped when the
   machine allows it, else every adapter file is read with O_DIRECT.
3. Resident decode while adapters load: the background batch's tokens/s with and without cold loads.
4. S-LoRA workload: n adapters of ranks {8,16,32,64} on every module (lora_alpha = 2r), popularity
   floor(power(alpha) * n) for alpha 1 and 0.1, Poisson arrivals, input and output lengths U[8, 512); every
   adapter registered on the disk tier, one file per adapter the trace uses; GPU pool and host tier smaller
   than the working set. The same trace on the base-only engine.

    python bench/run.py churn --out DIR [--quick] [--requests N] [--rate R] [--skip ttft decode slora]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from loraplane.engine.core.async_engine import AsyncEngine
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.sequence import SamplingParams
from loraplane.engine.lora.safetensors_io import read_file, read_file_direct
from loraplane.engine.lora.weights import module_shapes
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.runner import ModelRunner
from loraplane.engine.model.weights import random_model
from loraplane.kernels.launch_config import capture_policy, set_capture_policy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: shapes, synth
from shapes import LLAMA3_8B  # noqa: E402
from shapes import TINY_LLAMA as TINY  # noqa: E402

_spec = importlib.util.spec_from_file_location("lora_bench", HERE.parent / "lora" / "main.py")
lora_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lora_bench)  # the S-LoRA trace generator of the multi-LoRA benchmark

RANKS = (8, 16, 32, 64)
BACKGROUND = 64  # the full decode batch of other tenants (8 with --quick)
sys.path.insert(0, str(HERE))
from peft_anchor import peft_row  # noqa: E402
from probes import StepClock, launch_counts, launches_since, triton_compiled  # noqa: E402
from resident import decode_under_loads, dump_profile, start_profile  # noqa: E402
from summary import report  # noqa: E402
from workload import (  # noqa: E402
    first_token_ms,
    measure_floors,
    serve_trace,
    write_adapter_files,
)


class Bench:
    def __init__(self, args, device: torch.device | None = None) -> None:
        self.quick = args.quick
        self.device = device or torch.device("cpu" if self.quick else "cuda")
        self.dtype = torch.float32 if self.quick else torch.bfloat16
        raw = TINY if self.quick else LLAMA3_8B
        self.cfg = ModelConfig.from_dict(raw, max_model_len=2048)
        self.tmp = Path(tempfile.mkdtemp(prefix="churn-bench-", dir=args.dir))
        (self.tmp / "config.json").write_text(json.dumps(raw))
        self.common = dict(model=str(self.tmp), max_model_len=2048, max_num_seqs=128, max_num_batched_tokens=8192,
                           gpu_memory_utilization=0.85, device=self.device.type,
                           dtype=str(self.dtype).removeprefix("torch."))  # fmt: skip
        if self.quick:
            self.common["num_kv_blocks"] = 8192
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.row_bytes = sum(
            self.cfg.num_layers * (i + o) * elem for i, o in module_shapes(self.cfg).values()
        )
        self.args = args
        self.reader = read_file
        self.background = 8 if self.quick else BACKGROUND
        self.slora_folders: dict[str, Path] = {}
        self.slora_adapters: dict[float, list[str]] = {}  # alpha -> each request's adapter key

    def adapter_bytes(self, rank: int) -> int:
        return rank * self.row_bytes

    # -- engines -------------------------------------------------------------------------------------------
    def engine(self, model, lora: bool) -> AsyncEngine:
        gib = 1 << 30
        extra = {}
        if lora:
            pool = int(self.args.pool_gib * gib) if not self.quick else 40 * 64 * self.row_bytes
            host = int(self.args.host_gib * gib) if not self.quick else 60 * 64 * self.row_bytes
            extra = dict(lora_pool_bytes=pool, lora_host_bytes=host, max_lora_rank=64)
        cfg = EngineConfig(enable_lora=lora, **extra, **self.common)
        runner = ModelRunner(cfg, model=model, model_config=self.cfg)
        return AsyncEngine(LLMEngine(cfg, runner=runner))

    @staticmethod
    def free(engine: AsyncEngine, model) -> None:
        engine.close()
        for layer in model.model.layers:  # the runner's KV lives on the model's layers
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
        engine.engine.runner.graphs = None
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


async def background(
    b: Bench, engine: AsyncEngine, adapters: list, tokens: list[float], stop: asyncio.Event, decoding: set
) -> None:
    """A full decode batch of other tenants: long requests whose every token time is recorded (``decoding``:
    the requests past their prefill)."""
    params = SamplingParams(temperature=0.0, max_tokens=1400, ignore_eos=True)
    prompt = list(range(1, 33 if b.quick else 513))

    async def one(i: int) -> None:
        stream = engine.add_request(prompt, params, adapter=adapters[i % len(adapters)])
        async for _ in stream:
            tokens.append(time.perf_counter())
            decoding.add(i)
            if stop.is_set():
                await stream.aclose()  # aborts the request
                return

    await asyncio.gather(*(one(i) for i in range(b.background)))


async def ttft_rows(b: Bench, engine: AsyncEngine, label: str, floors: dict, lora: bool) -> list[dict]:
    """TTFT per tier, idle then under the background batch, plus resident decode with and without loads."""
    rows, drawn = [], iter(range(1, 1 << 30))
    # A new 256-token prompt for every request: with one prompt, every sample after the first found its
    # blocks in the prefix cache, and base requests (whose cache is not salted by an adapter) then prefilled
    # almost nothing, so the base TTFT was not a 256-token prefill's.
    prompt = lambda: np.random.default_rng(next(drawn)).integers(1, 500, 256).tolist()  # noqa: E731
    manager = engine.engine.runner.lora
    clock = StepClock(engine)
    samples = b.args.samples
    folders = {}
    if lora:
        manager.read = b.reader  # the disk tier reads the disk itself
        names = [f"t{i}" for i in range(8 + 2 * samples * 3 + 70)]
        folders = write_adapter_files(b, b.tmp / "ttft", {n: 16 for n in names}, drop=True)
        for n in names:
            await engine.load_adapter(n, "v1", folders[n], f"sha256:{n}", on_disk=True)
        for i in range(8):  # the other tenants' adapters: resident
            await engine.pin_adapter(f"t{i}", "v1", True)
            await engine.warm_adapter(f"t{i}", "v1")
        # compiles the prefill LoRA kernels outside the timing
        await first_token_ms(engine, prompt(), "t0@v1")
    await first_token_ms(engine, prompt(), None)
    spare = iter(range(8, 10_000))

    async def cold(tier: str) -> str | None:
        """A fresh adapter on ``tier`` (its file not read since the page cache was dropped, or read past it)."""
        if tier == "base":
            return None
        name = f"t{next(spare)}"
        key = f"{name}@v1"
        if tier == "gpu":
            await engine.warm_adapter(name, "v1")
        elif tier == "host":
            weights = await asyncio.to_thread(manager.parse, folders[name])
            with manager.lock:
                manager.host.put(key, weights, manager._host_evictable)
        assert manager.tier_of(key) == tier, (key, manager.tier_of(key), tier)
        return key

    skip = b.args.skip
    tiers = (("base", "gpu", "host", "disk") if lora else ("base",)) if "ttft" not in skip else ()
    for state in ("idle", "loaded") if tiers else ("loaded",):
        stop, tokens, decoding = asyncio.Event(), [], set()
        bg = None
        if state == "loaded":
            bg = asyncio.create_task(
                background(
                    b, engine, [f"t{i}@v1" for i in range(8)] if lora else [None], tokens, stop, decoding
                )
            )
            while len(decoding) < b.background:  # every prompt prefilled: the samples see decode steps only
                await asyncio.sleep(0.05)
        for tier in tiers:
            ms, stages, steps = [], [], []
            for _ in range(samples):
                key = await cold(tier)
                start, compiled, launched = time.perf_counter(), triton_compiled(), launch_counts()
                ms.append(await first_token_ms(engine, prompt(), key))
                steps.append(
                    {
                        **clock.window(start, time.perf_counter() + 1e-3),
                        "compiles": triton_compiled() - compiled,
                        "launches": launches_since(launched),
                    }
                )
                stages.append(manager.info(key).timings if key else {})
            if os.environ.get("CHURN_PROFILE"):  # one more sample under torch.profiler, not counted
                key = await cold(tier)
                prof = start_profile(f"{label} TTFT {tier}, {state}")
                await first_token_ms(engine, prompt(), key)
                if prof is not None:
                    dump_profile(prof, f"{label} TTFT {tier}, {state}")
            rows.append({"case": f"{label} TTFT {tier}, {state}", "section": "ttft", "tier": tier, "state": state,
                         "ttft_ms": statistics.median(ms), "samples_ms": [round(x, 1) for x in ms],
                         "stages_ms": _median_stages(stages), "sample_steps": steps})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        if state == "loaded":
            if "decode" not in skip:
                rows += await decode_under_loads(b, engine, label, tokens, cold if lora else None, clock)
            stop.set()
            await bg
    return rows


async def slora_rows(b: Bench, engine: AsyncEngine, label: str, trace, lora: bool) -> list[dict]:
    arrivals, prompts, lens_out = trace
    n, rows, clock = len(prompts), [], StepClock(engine)
    if not lora:
        t_start = time.perf_counter()
        r = await serve_trace(engine, arrivals, prompts, lens_out, [None] * n, tier_of=lambda key: "base")
        rows.append(
            {
                "case": f"S-LoRA trace {label} ({n} req, {b.args.rate}/s)",
                "section": "slora",
                "alpha": None,
                **r,
                **clock.window(t_start, time.perf_counter()),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        return rows
    manager = engine.engine.runner.lora
    manager.read = read_file  # files just written: the page cache serves them (see the notes)
    used = sorted(
        {i for alpha in b.args.alphas for i in lora_bench.make_assignment(b.args.adapters, n, alpha)}
    )
    folders = write_adapter_files(
        b, b.tmp / "slora", {f"s{i}": RANKS[i % 4] for i in used}, drop=False, link=True
    )
    b.slora_folders = folders  # the PEFT anchor reads the same folders
    template = folders[f"s{used[0]}"]
    for i in range(b.args.adapters):  # every adapter registered on the disk tier (unused ones share a folder)
        folder = folders.get(f"s{i}", template)
        manager.register_on_disk(f"s{i}", "v1", folder, f"sha256:s{i}")
    for alpha in b.args.alphas:
        for v in manager.versions.values():  # count this trace's loads only
            v.timings.pop("disk_read", None)
        adapters = [f"s{i}@v1" for i in lora_bench.make_assignment(b.args.adapters, n, alpha)]
        b.slora_adapters[alpha] = adapters
        working = sum(b.adapter_bytes(RANKS[int(a[1:].split("@")[0]) % 4]) for a in set(adapters))
        before, compiled, t_start = dict(manager.tier_stats()), triton_compiled(), time.perf_counter()
        launched = launch_counts()
        r = await serve_trace(engine, arrivals, prompts, lens_out, adapters, manager.tier_of)
        loads = [manager.info(k).timings for k, v in manager.versions.items() if "disk_read" in v.timings]
        rows.append({"case": f"S-LoRA trace {label} alpha={alpha} ({n} req, {b.args.rate}/s, {b.args.adapters} adapters)",
                     "section": "slora", "alpha": alpha, **r, "working_set_gb": working / 1e9,
                     "gpu_pool_gb": before["gpu"]["capacity"] / 1e9, "host_tier_gb": before["host"]["capacity"] / 1e9,
                     "disk_loads": len(loads), "max_loads_in_flight": manager.loader.max_in_flight,
                     "load_read_ms_p50": _p50(loads, "disk_read"), "load_hash_ms_p50": _p50(loads, "disk_hash"),
                     "load_stack_ms_p50": _p50(loads, "disk_stack"),
                     "arena_misses": manager.arena_misses, "triton_compiles": triton_compiled() - compiled,
                     "launches": launches_since(launched), **clock.window(t_start, time.perf_counter())})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _median_stages(stages: list[dict]) -> dict:
    """Per load stage (disk_read, disk_stack, disk_hash, gpu_copy_issue, gpu_copy), the median in ms."""
    names = {k for t in stages for k in t if k not in ("load", "warm")}
    return {k: round(statistics.median(t[k] for t in stages if k in t) * 1e3, 2) for k in sorted(names)}


def _p50(loads: list[dict], key: str) -> float | None:
    values = [t[key] for t in loads if key in t]  # a first read's hash may still run
    return statistics.median(values) * 1e3 if values else None


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench churn")
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the script only")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["ttft", "decode", "slora"],
        help="sections: ttft (TTFT by tier), decode (resident decode under loads), slora",
    )
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--rate", type=float, default=16.0)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--alphas", type=float, nargs="*", default=[1.0, 0.1])
    parser.add_argument(
        "--pool-gib", type=float, default=8.0, help="GPU adapter pool (below the working set)"
    )
    parser.add_argument("--host-gib", type=float, default=4.0, help="host tier (below the working set)")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where adapter files are written (a real disk)")
    parser.add_argument("--from-log", default=None, help="rebuild the report from a bench log's rows only")
    parser.add_argument(
        "--capture-policy", type=json.loads, default=None,
        help='CapturePolicy fields for the LoRA engine\'s decode graphs, as JSON (e.g. \'{"expand_beside": 1}\')',
    )  # fmt: skip
    parser.add_argument(
        "--peft-requests", type=int, default=8,
        help="the transformers + PEFT anchor serves this many of the trace's first requests (0: none)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.from_log:
        return from_log(Path(args.from_log), args)
    if args.quick:
        torch.set_num_threads(1)
        args.requests, args.rate, args.samples = min(args.requests, 16), 40.0, 1
    if args.capture_policy is not None:
        set_capture_policy(**args.capture_policy)
    torch.manual_seed(0)
    b = Bench(args)
    floors = measure_floors(b)
    floors["capture_policy"] = dataclasses.asdict(capture_policy())  # the LoRA decode graphs' launches
    if not floors["page_cache_dropped"]:
        b.reader = read_file_direct  # the disk is really read: past the page cache
    print(json.dumps(floors), flush=True)
    model = random_model(b.cfg, b.device, b.dtype)
    trace = lora_bench.make_trace(args.requests, args.rate, max_len=40 if args.quick else 512)
    rows: list[dict] = []
    for label, lora in (("base", False), ("LoRA", True)):
        engine = b.engine(model, lora)

        async def section(engine=engine, label=label, lora=lora) -> list[dict]:
            out = []
            if not {"ttft", "decode"} <= set(args.skip):
                out += await ttft_rows(b, engine, label, floors, lora)
            if "slora" not in args.skip:
                out += await slora_rows(b, engine, label, trace, lora)
            return out

        rows += asyncio.run(section())
        step = [r for r in rows if r["section"] == "slora" and r["case"].startswith("S-LoRA trace base")]
        if step:
            floors["decode_step_ms"] = step[0]["itl_p50_ms"]
        b.free(engine, model)
    if args.peft_requests and b.slora_adapters:
        alpha = args.alphas[0]
        try:
            rows.append(
                peft_row(b, trace, b.slora_adapters[alpha], b.slora_folders, alpha, args.peft_requests)
            )
        except ImportError as exc:  # an image without peft (see peft-wheels.txt): the other rows stand
            print(f"transformers + PEFT anchor skipped: {exc}", flush=True)
    return report(rows, floors, b)


def from_log(path: Path, args) -> dict:
    """The report of a run from the JSON lines its log holds (a run stopped by its time limit keeps the rows
    it finished): the floors line, then one line per row."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    floors = next(line for line in lines if "disk_gbs" in line)
    rows = [line for line in lines if "case" in line]
    step = [r for r in rows if r["section"] == "slora" and r["case"].startswith("S-LoRA trace base")]
    if step:
        floors["decode_step_ms"] = step[0]["itl_p50_ms"]
    b = Bench(args, device=torch.device("cuda"))
    shutil.rmtree(b.tmp)
    out = report(rows, floors, b)
    out["meta"] = {
        "rebuilt from": path.name,
        **{k: v for k, v in out["meta"].items() if "GB/s" in k or "dropped" in k},
    }
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(json.dumps(run(sys.argv[1:]), indent=1, default=str))
