"""Multi-LoRA engine benchmark on one GPU: a Llama-3-8B-shaped model with random bf16 weights and random adapters.

1. Decode step at batch 64, context 512: the base-only engine against the LoRA engine with n distinct r16
   all-module adapters (n = 0, 1, 2, 4, 8, 16, 32, 64), and 64 distinct q,v-only r8 adapters.
2. Bytes: what a q,v-only r8, an all-module r16 and an all-module r64 adapter cost in the GPU pools against
   their own tensor bytes (and against one page table spanning all seven modules at the same rank).
3. TTFT by tier: one 256-token request whose adapter is on the GPU, in pinned host RAM, or only on disk.
4. S-LoRA-style workload: 1000 adapters of ranks {8,16,32,64}, popularity floor(power(alpha) * n) for alpha
   1 and 0.1, Poisson arrivals, input and output lengths U[8, 512); the same trace on the base-only engine.

    python bench/run.py lora --out DIR [--quick] [--skip SECTION ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk
from loraplane.engine.core.sequence import SamplingParams, Sequence
from loraplane.engine.lora.weights import TARGET_MODULES, AdapterWeights, module_shapes
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.runner import ModelRunner
from loraplane.engine.model.weights import random_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared shapes
from shapes import LLAMA3_8B  # noqa: E402
from shapes import TINY_LLAMA as TINY  # noqa: E402
from synth import adapter_weights  # noqa: E402

CTX, B = 512, 64
QV = ("q_proj", "v_proj")


def timer(device: torch.device):
    def median_ms(fn, iters: int = 30, warmup: int = 5) -> float:
        if device.type == "cpu":  # --quick checks the script, not the speed
            iters, warmup = 2, 1
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    return median_ms


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def synth_weights(cfg: ModelConfig, rank: int, modules, dtype, seed: int, pin: bool) -> AdapterWeights:
    return adapter_weights(cfg, rank, modules, dtype, seed, pin)


def write_peft_folder(folder: Path, w: AdapterWeights) -> Path:
    """The same factors as a PEFT folder (scale 1: alpha = r), for the disk tier."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for m in w.ranks:
        parent = "self_attn" if m[0] in "qkvo" else "mlp"
        for layer in range(w.a[m].shape[0]):
            p = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{p}.lora_A.weight"] = w.a[m][layer].contiguous()
            tensors[f"{p}.lora_B.weight"] = w.b[m][layer].contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    r = max(w.ranks.values())
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": list(w.ranks), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def decode_batch(runner: ModelRunner, adapters: list[str | None]) -> ScheduledBatch:
    per = -(-(CTX + 1) // runner.block_size)
    chunks = []
    for i, key in enumerate(adapters):
        seq = Sequence([1] * CTX, SamplingParams(temperature=0.0), adapter=key)
        seq.block_table = list(range(i * per, (i + 1) * per))
        seq.num_computed_tokens = CTX - 1
        chunks.append(ScheduledChunk(seq, CTX - 1, 1, True))
    return ScheduledBatch(chunks)


def decode_rows(runner: ModelRunner, label: str, mixes: dict[str, list[str | None]], median_ms) -> list[dict]:
    for layer in runner.model.model.layers:  # random KV, never zeros
        layer.self_attn.k_cache.normal_()
        layer.self_attn.v_cache.normal_()
    rows = []
    for case, adapters in mixes.items():
        batch = decode_batch(runner, adapters)
        if runner.lora is not None:
            runner.lora.ensure_resident({a for a in adapters if a})
        graph_ms = median_ms(lambda b=batch: runner.forward_logits(b), iters=50)
        graphs, runner.graphs = runner.graphs, None
        eager_ms = median_ms(lambda b=batch: runner.forward_logits(b), iters=10)
        runner.graphs = graphs
        distinct = len({a for a in adapters if a})
        rows.append({"case": f"{label} decode B={len(adapters)} ctx={CTX} {case}", "section": "decode",
                     "distinct": distinct, "graph_ms": graph_ms, "eager_ms": eager_ms,
                     "tok_s": len(adapters) / graph_ms * 1e3})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bytes_rows(runner: ModelRunner, cfg: ModelConfig, dtype) -> list[dict]:
    lora, rows = runner.lora, []
    elem = torch.empty((), dtype=dtype).element_size()
    all_rows = sum(
        cfg.num_layers * (i + o) * elem for i, o in module_shapes(cfg).values()
    )  # one rank-row, 7 modules
    for name, rank, modules in (("q,v-only r8", 8, QV), ("all-module r16", 16, TARGET_MODULES),
                                ("all-module r64", 64, TARGET_MODULES)):  # fmt: skip
        w = synth_weights(cfg, rank, modules, dtype, seed=rank, pin=False)
        pool = lora.gpu.bytes_for(w)
        rows.append({"case": f"bytes {name}", "section": "bytes", "own_bytes": w.nbytes, "pool_bytes": pool,
                     "pool_x_own": pool / w.nbytes, "one_table_bytes": rank * all_rows,
                     "one_table_x_own": rank * all_rows / w.nbytes})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def ttft_rows(runner: ModelRunner, cfg: ModelConfig, engine_cfg, device, dtype, tmp: Path) -> list[dict]:
    engine, lora = LLMEngine(engine_cfg, runner=runner), runner.lora
    w = synth_weights(cfg, 16, TARGET_MODULES, dtype, seed=99, pin=device.type == "cuda")
    folder = write_peft_folder(tmp / "ttft", w)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = list(range(1, 257))

    def ttft(key: str | None) -> float:
        sync(device)
        t = time.perf_counter()
        engine.add_request(prompt, params, adapter=key)
        while engine.has_unfinished():
            engine.step()
        return (time.perf_counter() - t) * 1e3

    ttft(None)
    lora.register("ttft-warmup", "v1", folder, "warmup", lora.parse(folder))
    ttft("ttft-warmup@v1")  # compiles the prefill LoRA kernels outside the measurement
    rows = []
    for tier in ("base", "gpu", "host", "disk"):
        samples = []
        for i in range(3):
            key = None if tier == "base" else f"ttft-{tier}{i}@v1"
            if key is not None:
                lora.register(key.split("@")[0], "v1", folder, key, lora.parse(folder))
                if tier == "gpu":
                    lora.ensure_resident([key])
                if tier == "disk":
                    lora.host.drop(key)
                assert lora.tier_of(key) == tier, (key, lora.tier_of(key))
            samples.append(ttft(key))
        rows.append({"case": f"TTFT 256-token prompt, adapter in {tier}", "section": "ttft", "ttft_ms": statistics.median(samples),
                     "samples_ms": [round(s, 2) for s in samples]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def make_assignment(n_adapters: int, n_requests: int, alpha: float) -> list[int]:
    """The adapter index of each request: popularity floor(power(alpha) * n), the S-LoRA paper's draw
    (alpha 1: uniform; smaller alphas favour the last adapters)."""
    idx = np.floor(np.random.default_rng(1).power(alpha, n_requests) * n_adapters).astype(int)
    return [min(int(i), n_adapters - 1) for i in idx]


def make_trace(n_requests: int, rate: float, seed: int = 0, max_len: int = 512):
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n_requests))
    lens_in = rng.integers(8, max_len, n_requests)
    lens_out = rng.integers(8, max_len, n_requests)
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in lens_in]
    return arrivals, prompts, lens_out


def serve_trace(engine: LLMEngine, arrivals, prompts, lens_out, adapters) -> dict:
    n, t0 = len(prompts), time.perf_counter()
    arrived, first, last_t, itl, done_tokens = {}, {}, {}, [], 0
    nxt = 0
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            rid = f"r{nxt}"
            params = SamplingParams(temperature=0.0, max_tokens=int(lens_out[nxt]), ignore_eos=True)
            engine.add_request(prompts[nxt], params, request_id=rid, adapter=adapters[nxt])
            arrived[rid] = now
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        for out in engine.step():
            t = time.perf_counter() - t0
            done_tokens += len(out.new_token_ids)
            if out.request_id not in first:
                first[out.request_id] = t - arrived[out.request_id]
            else:
                itl.append(t - last_t[out.request_id])
            last_t[out.request_id] = t
    span = max(last_t.values()) - arrivals[0]
    ttft = np.array(list(first.values())) * 1e3
    itl_ms = np.array(itl) * 1e3
    return {"tok_s": done_tokens / span, "seconds": span, "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)), "itl_p50_ms": float(np.percentile(itl_ms, 50)),
            "itl_p99_ms": float(np.percentile(itl_ms, 99)), "distinct": len({a for a in adapters if a})}  # fmt: skip


def slora_rows(runner, engine_cfg, cfg, dtype, device, n_requests: int, rate: float, n_adapters: int,
               alphas, max_len: int) -> list[dict]:  # fmt: skip
    arrivals, prompts, lens_out = make_trace(n_requests, rate, max_len=max_len)
    rows = []
    if runner.lora is None:
        r = serve_trace(
            LLMEngine(engine_cfg, runner=runner), arrivals, prompts, lens_out, [None] * n_requests
        )
        rows.append({"case": f"S-LoRA trace base-only ({n_requests} req, {rate}/s)", "section": "slora", **r})
        print(json.dumps(rows[-1]), flush=True)
        return rows
    lora, ranks = runner.lora, (8, 16, 32, 64)
    shared = {
        r: synth_weights(cfg, r, TARGET_MODULES, dtype, seed=r, pin=device.type == "cuda") for r in ranks
    }
    for i in range(n_adapters):  # weights shared per rank on the host (values do not matter for speed)
        lora.register(f"s{i}", "v1", Path("/nonexistent"), f"s{i}", shared[ranks[i % 4]])
    for alpha in alphas:
        adapters = [f"s{i}@v1" for i in make_assignment(n_adapters, n_requests, alpha)]
        r = serve_trace(LLMEngine(engine_cfg, runner=runner), arrivals, prompts, lens_out, adapters)
        rows.append({"case": f"S-LoRA trace alpha={alpha} ({n_requests} req, {rate}/s, {n_adapters} adapters)",
                     "section": "slora", **r})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench lora")
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the script only")
    parser.add_argument("--skip", nargs="*", default=[], help="sections: decode bytes ttft slora")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=16.0)
    args = parser.parse_args(argv)
    quick = args.quick
    if quick:
        torch.set_num_threads(1)
    device = torch.device("cpu" if quick else "cuda")
    dtype = torch.float32 if quick else torch.bfloat16
    torch.manual_seed(0)
    raw = TINY if quick else LLAMA3_8B
    cfg = ModelConfig.from_dict(raw, max_model_len=2048)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    (tmp / "config.json").write_text(json.dumps(raw))
    model = random_model(cfg, device, dtype)
    median_ms = timer(device)
    common = dict(model=str(tmp), max_model_len=2048, max_num_seqs=B, max_num_batched_tokens=8192,
                  gpu_memory_utilization=0.85, device=device.type, dtype=str(dtype).removeprefix("torch."))  # fmt: skip
    if quick:
        common["num_kv_blocks"] = B * (CTX // 16 + 2) + 64
    n_req, rate = (12, 50.0) if quick else (args.requests, args.rate)
    max_len = 40 if quick else 512
    rows: list[dict] = []
    # -- base-only engine (the model is not wrapped yet) --
    base_cfg = EngineConfig(enable_lora=False, **common)
    base = ModelRunner(base_cfg, model=model, model_config=cfg)
    if "decode" not in args.skip:
        rows += decode_rows(base, "base-only engine", {"no adapters": [None] * B}, median_ms)
    if "slora" not in args.skip:
        rows += slora_rows(base, base_cfg, cfg, dtype, device, n_req, rate, 1000, (), max_len)
    for layer in model.model.layers:  # the base runner's KV lives on the model's layers: free it
        layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
    base.graphs = None
    del base
    gc.collect()
    sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # -- LoRA engine: pools for 64 distinct r64 adapters on every module --
    elem = torch.empty((), dtype=dtype).element_size()
    row_bytes = sum(cfg.num_layers * (i + o) * elem for i, o in module_shapes(cfg).values())
    lora_cfg = EngineConfig(
        lora_pool_bytes=B * 64 * row_bytes, lora_host_bytes=16 << 30, max_lora_rank=64, **common
    )
    t0 = time.perf_counter()
    runner = ModelRunner(lora_cfg, model=model, model_config=cfg)
    init_s = time.perf_counter() - t0
    lora = runner.lora
    for i in range(B):
        lora.register(f"d{i}", "v1", Path("/nonexistent"), f"d{i}",
                      synth_weights(cfg, 16, TARGET_MODULES, dtype, seed=i, pin=device.type == "cuda"))  # fmt: skip
        lora.register(f"qv{i}", "v1", Path("/nonexistent"), f"qv{i}",
                      synth_weights(cfg, 8, QV, dtype, seed=1000 + i, pin=device.type == "cuda"))  # fmt: skip
    if "decode" not in args.skip:
        mixes = {
            f"{n} distinct r16": [f"d{i % n}@v1" if n else None for i in range(B)]
            for n in (0, 1, 2, 4, 8, 16, 32, 64)
        }
        mixes["64 distinct q,v-only r8"] = [f"qv{i}@v1" for i in range(B)]
        rows += decode_rows(runner, "LoRA engine", mixes, median_ms)
    if "bytes" not in args.skip:
        rows += bytes_rows(runner, cfg, dtype)
    if "ttft" not in args.skip:
        rows += ttft_rows(runner, cfg, lora_cfg, device, dtype, tmp)
    if "slora" not in args.skip:
        rows += slora_rows(runner, lora_cfg, cfg, dtype, device, n_req, rate, 1000, (1.0, 0.1), max_len)
    return {
        "title": "Multi-LoRA engine: Llama-3-8B-shaped, random bf16 weights and adapters, one H200",
        "columns": [
            "case",
            "distinct",
            "graph_ms",
            "eager_ms",
            "tok_s",
            "ttft_ms",
            "own_bytes",
            "pool_bytes",
            "pool_x_own",
            "one_table_x_own",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "itl_p50_ms",
            "itl_p99_ms",
        ],  # fmt: skip
        "rows": rows,
        "meta": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (--quick)",
            "torch": torch.__version__,
            "LoRA runner init s (profile + pools + KV + graph capture)": round(init_s, 1),
            "adapter pool bytes (GPU)": lora.gpu.capacity_bytes,
            "num_kv_blocks (LoRA engine)": runner.num_kv_blocks,
        },
        "notes": [
            "graph_ms: CUDA-graph decode forward (batch metadata built on the host, inputs in, logits out); "
            "eager_ms: the same without graphs. tok_s = batch / graph_ms.",
            "pool_x_own: GPU pool bytes / the adapter's own tensor bytes; one_table_x_own: the same under a single "
            "page table spanning all seven modules at the adapter's rank.",
            "S-LoRA trace: adapters' host weights are shared per rank (values do not matter for speed); every GPU "
            "load is a real host-to-device copy into its own pages.",
        ],
    }
