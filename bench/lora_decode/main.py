"""LoRA decode against its byte floor: B=64, context 512, CUDA-graph decode on the Llama-3-8B shape (random
bf16 weights and adapters, one GPU), each case next to the base step measured in the same run.

Cases: base-only rows in the LoRA engine; 1 adapter r16 on all modules (merged and unmerged); 64 distinct
r16 all-module adapters; 64 distinct q,v-only r8; a mixed batch (half base-only rows, 32 adapters of ranks
8-64); prefill T=2048 with 8 distinct r16 adapters (and with one, merged); 1..64 distinct r16 (unmerged) for
the plot; the cost of one merge. ``floor_ms`` = base step + the step's LoRA bytes / the copy bandwidth
measured in this run; ``target_ms`` is what the targets allow.

    python bench/run.py lora_decode --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from loraplane.engine.core.config import ATTENTION_MODULE_SETS, EngineConfig
from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk
from loraplane.engine.core.sequence import SamplingParams, Sequence
from loraplane.engine.lora.weights import TARGET_MODULES, module_shapes
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.runner import ModelRunner
from loraplane.engine.model.weights import random_model
from loraplane.kernels.compiles import triton_compiled
from loraplane.kernels.launch_config import capture_policy, set_capture_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: shared shapes and helpers
from lora.main import CTX, QV, B, decode_batch, sync, timer  # noqa: E402
from shapes import LLAMA3_8B  # noqa: E402
from shapes import TINY_LLAMA as TINY  # noqa: E402
from synth import adapter_weights  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pdl_rows import pdl_rows  # noqa: E402
from step_profile import step_profile  # noqa: E402
from sweep import SWEEP, recapture, sweep_policies  # noqa: E402

PREFILL_SEQS, PREFILL_LEN = 8, 256  # T = 2048
MIXED_RANKS = (8, 16, 32, 64)


def copy_bandwidth(device: torch.device, median_ms) -> float:
    """Device copy bandwidth in bytes/s (read + write of a 1 GiB buffer)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=20)
    return 2 * n / (ms * 1e-3)


def prefill_batch(runner: ModelRunner, adapters: list[str | None]) -> ScheduledBatch:
    per = -(-PREFILL_LEN // runner.block_size)
    chunks = []
    for i, key in enumerate(adapters):
        seq = Sequence([1 + (i + t) % 500 for t in range(PREFILL_LEN)], SamplingParams(temperature=0.0),
                       adapter=key)  # fmt: skip
        seq.block_table = list(range(i * per, (i + 1) * per))
        chunks.append(ScheduledChunk(seq, 0, PREFILL_LEN, True))
    return ScheduledBatch(chunks)


def measure(runner: ModelRunner, batch: ScheduledBatch, median_ms, merge: bool) -> float:
    """Median ms of one forward (inputs in, logits out); ``merge`` False: the merger is left out."""
    keys = {c.seq.adapter for c in batch.chunks if c.seq.adapter}
    if runner.lora is not None:
        runner.lora.ensure_resident(keys)
    merger = runner.merger
    if not merge:
        runner.merger = None
    try:
        return median_ms(lambda: runner.forward_logits(batch), iters=50)
    finally:
        runner.merger = merger


def host_ms(runner: ModelRunner, batch: ScheduledBatch, iters: int = 30) -> float:
    """Median host ms of one forward until its work is queued (inputs, LoRA metadata, graph launch); the
    device is idle meanwhile, so this is part of the step."""
    merger, runner.merger = runner.merger, None
    times = []
    try:
        for _ in range(iters):
            t = time.perf_counter()
            runner.forward_logits(batch)
            times.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize() if runner.device.type == "cuda" else None
    finally:
        runner.merger = merger
    return sorted(times)[len(times) // 2]


def register_adapters(runner: ModelRunner, cfg: ModelConfig, dtype, pin: bool) -> None:
    """d0..d63: r16 all modules; qv0..qv63: q,v-only r8; m0..m31: ranks 8-64 all modules. Host weights
    are shared per kind (values do not matter for speed); each adapter gets its own GPU pages."""
    lora = runner.lora
    kinds = {"d": (16, TARGET_MODULES, 64), "qv": (8, QV, 64)}
    for prefix, (rank, modules, n) in kinds.items():
        w = adapter_weights(cfg, rank, modules, dtype, seed=rank, pin=pin)
        for i in range(n):
            lora.register(f"{prefix}{i}", "v1", Path("/nonexistent"), f"{prefix}{i}", w)
    mixed = {r: adapter_weights(cfg, r, TARGET_MODULES, dtype, seed=100 + r, pin=pin) for r in MIXED_RANKS}
    for i in range(32):
        lora.register(f"m{i}", "v1", Path("/nonexistent"), f"m{i}", mixed[MIXED_RANKS[i % 4]])


def lora_bytes(runner: ModelRunner, adapters) -> int:
    keys = {a for a in adapters if a}
    runner.lora.ensure_resident(keys)
    return sum(runner.lora.gpu.bytes_of[k] for k in keys)


def row(
    case: str, step_ms: float, base_ms: float, nbytes: int, bw: float, target: float | None, **extra
) -> dict:
    floor = base_ms + nbytes / bw * 1e3
    out = {"case": case, "step_ms": step_ms, "base_step_ms": base_ms, "x_base": step_ms / base_ms,
           "lora_bytes": nbytes, "floor_ms": floor, "x_floor": step_ms / floor, "target_ms": target,
           "meets": None if target is None else step_ms <= target, **extra}  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench lora_decode")
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the script only")
    parser.add_argument(
        "--sweep", action="store_true", help="try SWEEP's capture policies first, keep the fastest"
    )
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="the sweep's rows and --pdl's pairs alone, without the case rows (a short device call)",
    )
    parser.add_argument(
        "--pdl", action="store_true",
        help="end with the base and 64-distinct steps without and with programmatic dependent launch",
    )  # fmt: skip
    parser.add_argument(
        "--policies", type=json.loads, default=None,
        help='the policies to sweep instead of SWEEP, as JSON (e.g. \'[{}, {"pdl": true}]\'); implies --sweep',
    )  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.quick else "cuda")
    dtype = torch.float32 if args.quick else torch.bfloat16
    if args.quick:
        torch.set_num_threads(1)
    torch.manual_seed(0)
    started = time.perf_counter()  # progress on stderr: a run cut short still says how far it got
    say = lambda what: print(f"# {time.perf_counter() - started:.0f} s: {what}", file=sys.stderr, flush=True)  # noqa: E731
    raw = TINY if args.quick else LLAMA3_8B
    cfg = ModelConfig.from_dict(raw, max_model_len=2048)
    tmp = Path(tempfile.mkdtemp(prefix="lora-decode-bench-"))
    (tmp / "config.json").write_text(json.dumps(raw))
    model = random_model(cfg, device, dtype)
    median_ms = timer(device)
    bw = copy_bandwidth(device, median_ms)
    say("model ready")
    common = dict(model=str(tmp), max_model_len=2048, max_num_seqs=B, max_num_batched_tokens=4096,
                  gpu_memory_utilization=0.85, device=device.type, dtype=str(dtype).removeprefix("torch."))  # fmt: skip
    # KV for B sequences of CTX tokens (and the prefill's): both engines stay alive side by side
    common["num_kv_blocks"] = B * (CTX // 16 + 2) + 64
    # Every decode case runs B rows: graphs of other sizes (and their compiles) would only delay the first row.
    common["cuda_graph_batch_sizes"] = (B,)
    # -- the base engine: the reference steps, measured again beside every decode case --
    base = ModelRunner(EngineConfig(enable_lora=False, **common), model=model, model_config=cfg)
    for layer in model.model.layers:  # random KV, never zeros
        layer.self_attn.k_cache.normal_()
        layer.self_attn.v_cache.normal_()
    base_pre = measure(base, prefill_batch(base, [None] * PREFILL_SEQS), median_ms, False)
    # Its graphs keep reading these KV tensors after the LoRA engine attaches its own to the layers.
    base_kv = [(layer.self_attn.k_cache, layer.self_attn.v_cache) for layer in model.model.layers]
    base_batch = decode_batch(base, [None] * B)
    base_host = host_ms(base, base_batch)
    say("base engine ready")
    base_samples: list[float] = []
    wrapped: list = []  # the LoRA engine's step state, once it wraps the shared model

    def base_decode() -> float:
        for state in wrapped:  # without graphs (--quick) the base engine runs the wrapped model: no LoRA
            state.metas, state.merged = dict.fromkeys(state.pools), False
        base_samples.append(measure(base, base_batch, median_ms, False))
        return base_samples[-1]

    # -- the LoRA engine with merging on --
    elem = torch.empty((), dtype=dtype).element_size()
    row_bytes = sum(cfg.num_layers * (i + o) * elem for i, o in module_shapes(cfg).values())
    lora_cfg = EngineConfig(lora_pool_bytes=2560 * row_bytes, lora_host_bytes=16 << 30, max_lora_rank=64,
                            lora_merge=True, lora_merge_after_steps=4, lora_graph_module_sets=ATTENTION_MODULE_SETS,
                            lora_kernel_warmup=False, **common)  # fmt: skip
    # No start-up warm-up of the eager LoRA launches: it compiles every rank, size and module class a server
    # may meet (216 forwards here: minutes of compiling on a bare GPU), while the prefill rows compile their own few shapes
    # in their untimed first runs.
    t0 = time.perf_counter()
    runner = ModelRunner(lora_cfg, model=model, model_config=cfg)
    init_s = time.perf_counter() - t0
    wrapped.append(runner.lora_state)
    for layer in model.model.layers:
        layer.self_attn.k_cache.normal_()
        layer.self_attn.v_cache.normal_()
    register_adapters(runner, cfg, dtype, pin=device.type == "cuda")
    say(
        f"LoRA engine ready ({init_s:.0f} s, {triton_compiled()} Triton kernels compiled) and adapters registered"
    )
    rows: list[dict] = []

    def decode(case, adapters, target_x=None, merge=False, families=True):
        """One decode case, with the base step measured just before it (same clocks, same thermal state).
        ``families`` False: the all-module LoRA graphs serve the step (no module-set family)."""
        base_dec = base_decode()
        nbytes = lora_bytes(runner, adapters) if any(adapters) else 0
        target = base_dec * target_x if target_x else base_dec + 1.3 * nbytes / bw * 1e3 + 0.2
        merged_before = runner.merger.stats["merged_steps"]
        module_graphs = runner.module_graphs
        if not families:
            runner.module_graphs = {}
        try:
            batch = decode_batch(runner, adapters)
            ms = measure(runner, batch, median_ms, merge)
            host = host_ms(runner, batch) if not merge else None
        finally:
            runner.module_graphs = module_graphs
        distinct = len({a for a in adapters if a})
        merged_steps = runner.merger.stats["merged_steps"] - merged_before  # steps served on W'
        rows.append(row(case, ms, base_dec, nbytes, bw, target, section="decode", distinct=distinct,
                        merged_steps=merged_steps, host_ms=host, base_host_ms=base_host))  # fmt: skip

    one = ["d0@v1"] * B
    d64 = [f"d{i}@v1" for i in range(B)]
    mixed = [None if i % 2 == 0 else f"m{i // 2}@v1" for i in range(B)]
    if (args.sweep or args.policies) and device.type == "cuda":
        qv = [f"qv{i}@v1" for i in range(B)]
        sweep_rows, best = sweep_policies(
            runner,
            {"one": one, "d64": d64, "qv64": qv, "mixed": mixed},
            lambda ads: measure(runner, decode_batch(runner, ads), median_ms, False),
            base_decode,
            tuple(args.policies or SWEEP),
            B,
        )
        rows += sweep_rows
        set_capture_policy(**best)
        if not args.sweep_only:  # the PDL pairs capture their own
            recapture(runner, tuple(s for s in lora_cfg.cuda_graph_batch_sizes if s <= B))
    if not args.sweep_only:  # the case rows (--sweep-only: the sweep and the PDL pairs alone)
        decode("base-only rows, LoRA engine", [None] * B, 1.02)
        decode("1 adapter r16 all modules, merged", one, 1.05, merge=True)
        decode("1 adapter r16 all modules, unmerged", one, 1.05)
        decode("64 distinct r16 all modules", d64)
        decode("64 distinct q,v-only r8", [f"qv{i}@v1" for i in range(B)], 1.05)
        decode(
            "64 distinct q,v-only r8, all-module graphs",
            [f"qv{i}@v1" for i in range(B)],
            1.05,
            families=False,
        )
        decode(
            "mixed: 32 base-only rows, 32 adapters r8-64",
            [None if i % 2 == 0 else f"m{i // 2}@v1" for i in range(B)],
        )
        if device.type == "cuda":  # where a step's GPU time goes (LoRA kernels, the rest, gaps)
            for case, engine, ads in (("profile: base engine", base, [None] * B), ("profile: 64 distinct r16", runner, d64),
                                      ("profile: 64 distinct q,v-only r8", runner, [f"qv{i}@v1" for i in range(B)])):  # fmt: skip
                batch = decode_batch(engine, ads)
                rows.append(
                    {
                        "case": case,
                        "section": "profile",
                        **step_profile(lambda e=engine, b=batch: e.forward_logits(b)),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        for n in (2, 4, 8, 16, 32):
            decode(f"{n} distinct r16 all modules", [f"d{i % n}@v1" for i in range(B)])
        # -- prefill T = 2048 --
        eight = [f"d{i}@v1" for i in range(8)]
        for case, ads, merge, first in (("prefill T=2048, 8 distinct r16", eight, False, True),
                                        ("prefill T=2048, 8 distinct r16, GEMM first", eight, False, False),
                                        ("prefill T=2048, 1 adapter r16, merged", ["d0@v1"] * 8, True, True),
                                        ("prefill T=2048, 1 adapter r16, unmerged", ["d0@v1"] * 8, False, True)):  # fmt: skip
            nbytes = lora_bytes(runner, ads)
            runner.lora_state.delta_first = first  # off: the GEMM into y, then the expand adds (reads y)
            try:
                ms = measure(runner, prefill_batch(runner, ads), median_ms, merge)
            finally:
                runner.lora_state.delta_first = True
            rows.append(row(case, ms, base_pre, nbytes, bw, base_pre * 1.10, section="prefill",
                            distinct=len(set(ads))))  # fmt: skip
        # -- what one merge costs: W' = W + delta for every projection (the merged weights dropped first) --
        merger = runner.merger
        samples = []
        for key in ("d1@v1", "d2@v1", "d1@v1"):
            merger.held = None
            sync(device)
            t = time.perf_counter()
            merger.merge(key)
            sync(device)
            samples.append((time.perf_counter() - t) * 1e3)
        merge_ms = sorted(samples)[1]
        base_dec = base_decode()
        rows.append({"case": "one merge (all-module r16, every projection)", "section": "merge",
                     "step_ms": merge_ms, "base_step_ms": base_dec, "x_base": merge_ms / base_dec})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    if args.pdl and device.type == "cuda":
        d64_batch = decode_batch(runner, d64)

        def d64_step() -> tuple[float, torch.Tensor]:
            ms = measure(runner, d64_batch, median_ms, False)
            return ms, runner.forward_logits(d64_batch).clone()  # [B, V]: compared across the pair

        for r in pdl_rows(base, runner, base_kv, wrapped, B, base_decode, d64_step):
            rows.append(r)
            print(json.dumps(r), flush=True)
    return {
        "title": "LoRA decode against its byte floor: Llama-3-8B shape, B=64, context 512, CUDA graphs",
        "columns": [
            "case",
            "distinct",
            "step_ms",
            "base_step_ms",
            "x_base",
            "lora_bytes",
            "floor_ms",
            "x_floor",
            "target_ms",
            "meets",
            "merged_steps",
            "host_ms",
            "base_host_ms",
            "one_ms",
            "d64_ms",
            "qv64_ms",
            "mixed_ms",
            "sum_x_base",
            "sum_ms",
            "span_ms",
            "lora_kernel_ms",
            "other_kernel_ms",
            "gaps_ms",
            "n_kernels",
            "logits_max_abs_diff",
        ],  # fmt: skip
        "rows": rows,
        "meta": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (--quick)",
            "torch": torch.__version__,
            "copy bandwidth GB/s (1 GiB device copy, read + write)": round(bw / 1e9),
            "merged weights bytes (one copy of every projection)": runner.merger.bytes,
            "LoRA runner init s (profile + pools + KV + graph families)": round(init_s, 1),
            "capture policy of the LoRA graphs": str(capture_policy()),
            "LoRA graph module sets (besides all modules)": [sorted(m) for m in runner.module_graphs or {}],
            "base decode step over the run, ms (min, max)": (
                (round(min(base_samples), 3), round(max(base_samples), 3)) if base_samples else None
            ),
            "base-only engine's graphs kept beside the LoRA engine's": len(base_kv) > 0,
        },
        "notes": [
            "step_ms: median forward (batch metadata and inputs in, logits out); decode replays CUDA graphs, "
            "prefill runs eagerly. base_step_ms: the base-only engine's step, same batch shape, measured just "
            "before each decode case (both engines stay alive on the same weights).",
            "host_ms: median host time of the forward until its work is queued (the device waits for it); "
            "base_host_ms: the same for the base engine's step.",
            "profile rows (CUDA): one step's kernels under torch.profiler: span from the first kernel's start to "
            "the last one's end, the multi-LoRA kernels' busy time, the other kernels', and the gaps between kernels.",
            "floor_ms = base_step_ms + lora_bytes / copy bandwidth (each distinct adapter's pool bytes read once).",
            "target_ms: 1 adapter and q,v-only r8 <= 1.05x base; distinct and mixed: base + 1.3 x bytes/bandwidth "
            "+ 0.2 ms; prefill <= 1.10x base; base-only rows <= 1.02x base.",
            "sweep rows (--sweep): the LoRA graphs captured under each CapturePolicy, B=64 step ms of 1 adapter "
            "(one), 64 distinct r16 (d64), 64 q,v-only r8 (qv64) and the mixed batch, and their sum (sum_ms); the rows after them use the policy of the least sum_ms.",
            "merged: the adapter's delta inside a copy of the projection weights, so the step runs the base "
            "kernels on them (engine/lora/merge.py); unmerged: the multi-LoRA kernels.",
        ],
    }
