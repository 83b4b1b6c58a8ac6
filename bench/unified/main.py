"""Unified memory against a fixed 50/50 split, at the same total bytes: adapters resident and sequences running.

Two workloads, fed a fixed number of requests per engine step (both engines see the same arrivals):
- many adapters, short contexts: N r16 all-module adapters, uniform popularity, short prompts and outputs;
- long contexts, few adapters: 4 r16 adapters, long prompts.
Each runs on a split engine (half the bytes KV, half adapter pools) and on a unified engine (one arena per
layer). Reported: adapters resident and sequences running (mean over steps, mean over wall time, peak),
steps, preemptions, tokens per step, and the share of the arena held as KV.

    python bench/run.py unified --out DIR            # CPU, a small Llama shape, fp32 (counts need no GPU)
    python bench/run.py unified --out DIR --cuda     # one GPU, the Llama-3-8B shape, bf16, random weights
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.sequence import SamplingParams
from loraplane.engine.lora.layers import PROJECTIONS, LoRALinear
from loraplane.engine.lora.weights import TARGET_MODULES, AdapterWeights, module_shapes
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.runner import ModelRunner
from loraplane.engine.model.weights import random_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared shapes
from shapes import LLAMA3_8B  # noqa: E402
from synth import adapter_weights  # noqa: E402

SMALL_LLAMA = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 4}  # fmt: skip
RANK = 16

# name -> (cpu, cuda): adapters, arrivals per step, arrival steps, prompt range, output range
WORKLOADS = {
    "many adapters, short contexts": ((200, 4, 150, (8, 64), (8, 32)), (1000, 8, 200, (8, 256), (8, 64))),
    "long contexts, few adapters": ((4, 2, 12, (1536, 2048), (16, 48)), (4, 2, 24, (6144, 8192), (16, 48))),
}


def synth_weights(cfg: ModelConfig, dtype, seed: int) -> AdapterWeights:
    return adapter_weights(cfg, RANK, TARGET_MODULES, dtype, seed)


def make_trace(spec, seed: int) -> tuple[int, list[list[tuple[list[int], SamplingParams, str]]]]:
    n_adapters, per_step, steps, (p0, p1), (o0, o1) = spec
    rng = np.random.default_rng(seed)
    trace = []
    for _ in range(steps):
        arrivals = []
        for _ in range(per_step):
            prompt = rng.integers(1, 500, int(rng.integers(p0, p1))).tolist()
            sampling = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(o0, o1)), ignore_eos=True)
            arrivals.append((prompt, sampling, f"u{int(rng.integers(0, n_adapters))}@v1"))
        trace.append(arrivals)
    return n_adapters, trace


def drive(engine: LLMEngine, trace) -> dict:
    """Feed the trace a step's arrivals at a time; sample residency and concurrency after every step."""
    runner, scheduler = engine.runner, engine.scheduler
    memory = runner.memory
    resident, running, kv_share, frag, dts = [], [], [], [], []
    seqs, tokens, step, t_start = [], 0, 0, time.perf_counter()
    while step < len(trace) or engine.has_unfinished():
        for prompt, sampling, adapter in trace[step] if step < len(trace) else ():
            seqs.append(engine.add_request(prompt, sampling, adapter=adapter))
        t = time.perf_counter()
        tokens += sum(len(out.new_token_ids) for out in engine.step())
        dts.append(time.perf_counter() - t)
        resident.append(len(runner.lora.gpu.slots))
        running.append(len(scheduler.running))
        kv_share.append(memory.kind.count(-1) / memory.num_chunks if memory is not None else 0.5)
        if memory is not None:
            frag.append(memory.stats()["row_fragmentation"])
        step += 1
        if step > 50 * len(trace) + 10_000:
            raise RuntimeError("the workload does not finish")
    w = np.array(dts) / max(sum(dts), 1e-9)
    return {
        "steps": step,
        "wall_s": time.perf_counter() - t_start,
        "adapters_resident_mean": float(np.mean(resident)),
        "adapters_resident_time_mean": float(np.dot(w, resident)),
        "adapters_resident_peak": max(resident),
        "running_mean": float(np.mean(running)),
        "running_time_mean": float(np.dot(w, running)),
        "running_peak": max(running),
        "kv_share_mean": float(np.mean(kv_share)),
        "row_fragmentation_mean": float(np.mean(frag)) if frag else None,
        "preemptions": scheduler.num_preemptions,
        "tokens_per_step": tokens / step,
        "failed": sum(1 for s in seqs if s.finish_reason == "error"),
        "requests": len(seqs),
    }


def release(runner: ModelRunner) -> None:
    """Unwrap the shared model and drop this runner's KV, so the next engine starts from the bare model."""
    for layer in runner.model.model.layers:
        for parent_name, proj in PROJECTIONS:
            parent = getattr(layer, parent_name)
            module = getattr(parent, proj)
            if isinstance(module, LoRALinear):
                setattr(parent, proj, module.base_layer)
        layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
    runner.lora.close()
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench unified")
    parser.add_argument("--cuda", action="store_true", help="one GPU, the Llama-3-8B shape in bf16")
    parser.add_argument(
        "--total-mib", type=int, default=None, help="KV + adapters (default 64 CPU, 32768 CUDA)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device("cuda" if args.cuda else "cpu")
    dtype = torch.bfloat16 if args.cuda else torch.float32
    raw = LLAMA3_8B if args.cuda else SMALL_LLAMA
    max_len = 8192 + 64 if args.cuda else 2048 + 64
    cfg = ModelConfig.from_dict(raw, max_model_len=max_len)
    tmp = Path(tempfile.mkdtemp(prefix="unified-bench-"))
    (tmp / "config.json").write_text(json.dumps(raw))
    model = random_model(cfg, device, dtype)
    total = (args.total_mib or (32768 if args.cuda else 64)) << 20
    block_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    half_blocks = total // 2 // block_bytes
    common = dict(model=str(tmp), device=device.type, dtype=str(dtype).removeprefix("torch."), block_size=16,
                  max_model_len=max_len, max_num_seqs=64, max_num_batched_tokens=8192, enforce_eager=True,
                  num_kv_blocks=half_blocks, lora_pool_bytes=half_blocks * block_bytes, max_lora_rank=RANK,
                  lora_host_bytes=16 << 30, adapter_load_timeout_s=3600.0)  # fmt: skip
    weights = [
        synth_weights(cfg, dtype, seed) for seed in range(8)
    ]  # shared on the host: values do not matter
    if args.cuda:
        weights = [w.pin() for w in weights]
    rows = []
    for wi, (name, specs) in enumerate(WORKLOADS.items()):
        n_adapters, trace = make_trace(specs[int(args.cuda)], seed=wi)
        for mode in ("split", "unified"):
            runner = ModelRunner(EngineConfig(memory_mode=mode, **common), model=model, model_config=cfg)
            for i in range(n_adapters):
                runner.lora.register(f"u{i}", "v1", Path("/nonexistent"), f"u{i}", weights[i % len(weights)])
            engine = LLMEngine(runner.config, runner=runner)
            arena = runner.num_kv_blocks * runner.kv_block_bytes + (
                0 if mode == "unified" else runner.lora.gpu.capacity_bytes
            )
            row = {
                "workload": name,
                "mode": mode,
                "adapters": n_adapters,
                "total_mib": arena / 2**20,
                **drive(engine, trace),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            release(runner)
            del engine, runner
    for name in WORKLOADS:  # ratios measured in this run
        split, unified = (r for r in rows if r["workload"] == name)
        unified["resident_vs_split"] = unified["adapters_resident_mean"] / max(
            split["adapters_resident_mean"], 1e-9
        )
        unified["running_vs_split"] = unified["running_mean"] / max(split["running_mean"], 1e-9)
        unified["steps_vs_split"] = unified["steps"] / split["steps"]
    adapter_mib = (
        sum(module_shapes(cfg)[m][0] + module_shapes(cfg)[m][1] for m in TARGET_MODULES)
        * RANK
        * cfg.num_layers
        * dtype.itemsize
        / 2**20
    )
    return {
        "title": "Unified memory against a fixed 50/50 split at the same total bytes",
        "columns": [
            "workload",
            "mode",
            "adapters",
            "adapters_resident_mean",
            "adapters_resident_time_mean",
            "adapters_resident_peak",
            "running_mean",
            "running_time_mean",
            "running_peak",
            "kv_share_mean",
            "row_fragmentation_mean",
            "steps",
            "preemptions",
            "tokens_per_step",
            "failed",
            "resident_vs_split",
            "running_vs_split",
            "steps_vs_split",
        ],  # fmt: skip
        "rows": rows,
        "meta": {
            "device": torch.cuda.get_device_name() if args.cuda else "cpu",
            "shape": "Llama-3-8B" if args.cuda else "small Llama (4 layers, hidden 256, 8 heads, 4 KV heads)",
            "dtype": str(dtype),
            "total bytes (KV + adapters)": f"{total / 2**20:.0f} MiB; split: {half_blocks} KV blocks + {half_blocks * block_bytes / 2**20:.0f} MiB of pools",
            "one r16 all-module adapter": f"{adapter_mib:.2f} MiB; one KV block (16 tokens): {block_bytes / 2**20:.3f} MiB",
            "workloads (adapters, arrivals/step, steps, prompt, output)": {
                k: v[int(args.cuda)] for k, v in WORKLOADS.items()
            },
        },  # fmt: skip
        "notes": [
            "means are over engine steps (mean) and weighted by each step's wall time (time_mean)",
            "kv_share: the arena's share held as KV chunks (the split: 0.5 always)",
            "row_fragmentation: the share of adapter chunks' row bytes that are free rows (a live row holds its chunk)",
        ],
    }
