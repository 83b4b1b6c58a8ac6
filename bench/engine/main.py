"""Engine benchmark on one GPU: a Llama-3-8B-shaped model with random bf16 weights (built in memory).

1. Ceilings measured in the same run: device-to-device copy bandwidth, bf16 GEMM rate.
2. Decode step at batch {1, 16, 64, 128}, context 512: CUDA-graph forward and the whole runner step
   (inputs + forward + sampling), against the floor (weight bytes + KV bytes read) / bandwidth.
3. End to end: 256 requests (512 in, 128 out, greedy, ignore_eos) through LLMEngine, against transformers
   generate (batch 64, same weights shared in place) and against the end-to-end floor
   (prefill FLOPs / GEMM rate + per decode step (weights + KV) / bandwidth).

4. The parts measured against their own floors (floor.py): the paged decode kernel over batch x context
   inside CUDA graphs (--sweep first picks its split policy and launch shape), a mixed prefill + decode step
   against the same prefill alone plus the same decode alone, back-to-back prefill steps.
5. --profile DIR: torch.profiler notes of one decode step and one mixed step (step_profile.py).

    python bench/run.py engine --out DIR [--skip-hf] [--skip-e2e] [--sweep] [--profile DIR]
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

import torch

from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk
from loraplane.engine.core.sequence import SamplingParams, Sequence
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.runner import ModelRunner
from loraplane.engine.model.weights import hf_state_dict, random_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared shapes
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/engine: floor.py, profile.py
import floor  # noqa: E402
from shapes import LLAMA3_8B  # noqa: E402

CTX, BATCHES = 512, (1, 16, 64, 128)
E2E_REQUESTS, E2E_IN, E2E_OUT, HF_BATCH = 256, 512, 128, 64


def median_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(n: int = 1 << 30) -> float:
    """GB/s counting bytes read + written; 2 GiB of bf16 per buffer, far beyond the 60 MB L2."""
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * 2 * n / median_ms(lambda: dst.copy_(src), iters=20) / 1e6


def gemm_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / median_ms(lambda: a @ b, iters=20) / 1e9


def ceilings() -> dict:
    return {"copy_GBps": copy_bandwidth(), "gemm_TFLOPs": gemm_rate()}


def model_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads: every weight but the embedding table; non-embedding parameter count)."""
    embed = model.model.embed_tokens.weight
    read = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    return read, sum(p.numel() for p in model.parameters() if p is not embed)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


def make_seqs(runner: ModelRunner, n: int, length: int, first_block: int = 0) -> list[Sequence]:
    per = -(-(length + 1) // runner.block_size)
    gen = torch.Generator().manual_seed(n)
    seqs = []
    for i in range(n):
        ids = torch.randint(0, runner.vocab_size, (length,), generator=gen).tolist()
        seq = Sequence(ids, SamplingParams(temperature=0.0, max_tokens=E2E_OUT, ignore_eos=True))
        seq.block_table = list(range(first_block + i * per, first_block + (i + 1) * per))
        seqs.append(seq)
    return seqs


def decode_rows(runner: ModelRunner, cfg: ModelConfig, bw: float, weight_read: int) -> list[dict]:
    for layer in runner.model.model.layers:  # random KV, never zeros
        layer.self_attn.k_cache.normal_()
        layer.self_attn.v_cache.normal_()
    rows = []
    for B in BATCHES:
        seqs = make_seqs(runner, B, CTX)
        for s in seqs:
            s.num_computed_tokens = CTX - 1
        batch = ScheduledBatch([ScheduledChunk(s, CTX - 1, 1, True) for s in seqs])
        graph_ms = median_ms(lambda b=batch: runner.forward_logits(b), iters=30)
        step_ms = median_ms(lambda b=batch: runner.execute(b), iters=30)
        graphs, runner.graphs = runner.graphs, None
        eager_ms = median_ms(lambda b=batch: runner.forward_logits(b), iters=20)
        runner.graphs = graphs
        kv = B * CTX * kv_bytes_per_token(cfg)
        floor_ms = (weight_read + kv) / bw / 1e6
        rows.append({"case": f"decode B={B} ctx={CTX}", "batch": B, "floor_ms": floor_ms, "graph_ms": graph_ms,
                     "step_ms": step_ms, "eager_ms": eager_ms, "x_floor": graph_ms / floor_ms,
                     "step_x_floor": step_ms / floor_ms})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def e2e_floor(cfg: ModelConfig, n_params: int, bw: float, tflops: float, weight_read: int) -> float:
    lm_head = cfg.vocab_size * cfg.hidden_size
    per_token = 2 * (n_params - lm_head)
    attn = (
        4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (E2E_IN * (E2E_IN + 1) // 2)
    )  # causal QK^T + PV
    prefill_flops = E2E_REQUESTS * (E2E_IN * per_token + 2 * lm_head + attn)
    seconds = prefill_flops / (tflops * 1e12)
    for j in range(1, E2E_OUT):  # the first output token comes out of the prefill
        kv = E2E_REQUESTS * (E2E_IN + j) * kv_bytes_per_token(cfg)
        seconds += (weight_read + kv) / (bw * 1e9)
    return seconds


def breakdown_rows(
    runner: ModelRunner, floor_weights: int, bw: float, tflops: float, n_params: int
) -> list[dict]:
    """The two step kinds the end-to-end run is made of: a full 8192-token prefill and a B=256 decode."""
    cfg = runner.model_config
    seqs = make_seqs(runner, 16, E2E_IN, first_block=0)
    prefill = ScheduledBatch([ScheduledChunk(s, 0, E2E_IN, True) for s in seqs])
    prefill_ms = median_ms(lambda: runner.forward_logits(prefill), iters=5, warmup=2)
    lm_head = cfg.vocab_size * cfg.hidden_size  # scored for the 16 last rows only
    attn = 4 * cfg.num_layers * cfg.q_size * (E2E_IN * (E2E_IN + 1) // 2)
    flops = 16 * (E2E_IN * 2 * (n_params - lm_head) + 2 * lm_head + attn)
    ctx = E2E_IN + E2E_OUT // 2
    dseqs = make_seqs(runner, 256, ctx, first_block=2000)
    for s in dseqs:
        s.num_computed_tokens = ctx - 1
    decode = ScheduledBatch([ScheduledChunk(s, ctx - 1, 1, True) for s in dseqs])
    decode_ms = median_ms(lambda: runner.forward_logits(decode), iters=20)
    step_ms = median_ms(lambda: runner.execute(decode), iters=20)
    floor_ms = (floor_weights + 256 * ctx * kv_bytes_per_token(cfg)) / bw / 1e6
    return [
        {"case": f"prefill 16x{E2E_IN} (8192 tok, eager)", "graph_ms": prefill_ms, "floor_ms": flops / tflops / 1e9,
         "x_floor": prefill_ms / (flops / tflops / 1e9)},
        {"case": f"decode B=256 ctx={ctx}", "batch": 256, "floor_ms": floor_ms, "graph_ms": decode_ms,
         "step_ms": step_ms, "x_floor": decode_ms / floor_ms, "step_x_floor": step_ms / floor_ms},
    ]  # fmt: skip


def run_engine_e2e(runner: ModelRunner, engine_cfg: EngineConfig) -> dict:
    engine = LLMEngine(engine_cfg, runner=runner)
    timing = {"decode_s": 0.0, "mixed_s": 0.0, "decode_steps": 0, "mixed_steps": 0}
    each: list[tuple[str, int, float]] = []  # (kind, tokens, ms) per step
    execute = runner.execute

    def timed_execute(batch):  # execute() ends in a host transfer, so wall time is GPU time + host prep
        t = time.perf_counter()
        out = execute(batch)
        kind = "decode" if batch.is_decode_only else "mixed"
        dt = time.perf_counter() - t
        timing[f"{kind}_s"] += dt
        timing[f"{kind}_steps"] += 1
        each.append((kind, batch.num_tokens, round(dt * 1e3, 2)))
        return out

    seqs = make_seqs(runner, E2E_REQUESTS, E2E_IN)
    prompts = [s.prompt_token_ids for s in seqs]
    params = SamplingParams(temperature=0.0, max_tokens=E2E_OUT, ignore_eos=True)
    # warm-up on the same step kinds (full prefills, a chunked prompt, mixed steps, decode-only steps)
    engine.generate(
        [p[:500] for p in prompts[:24]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    runner.execute = timed_execute  # after the warm-up: only the measured run is split into step kinds
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert all(len(o) == E2E_OUT for o in outs)
    runner.execute = execute
    timing["engine_overhead_s"] = elapsed - timing["decode_s"] - timing["mixed_s"]
    print(json.dumps(timing), flush=True)
    return {
        "seconds": elapsed,
        "timing": timing,
        "steps": each,
        "tok_s": E2E_REQUESTS * E2E_OUT / elapsed,
        "preemptions": engine.num_preemptions,
        "prompts": prompts,
        "first_outputs": outs[:4],
    }


def run_hf_generate(model, prompts: list[list[int]]) -> dict:
    import transformers

    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(hf_state_dict(model), assign=True, strict=True)  # shares our tensors: no copy
    with torch.device("cuda"):  # the only buffer: meta-initialised, so rebuild it on the GPU
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg)
    hf = hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    def gen(batch):
        ids = torch.tensor(batch, device="cuda")
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=E2E_OUT, do_sample=False)

    with torch.inference_mode():
        gen(prompts[:2])  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = [gen(prompts[i : i + HF_BATCH]) for i in range(0, len(prompts), HF_BATCH)]
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    first = outs[0][:4, E2E_IN:].tolist()
    return {"seconds": elapsed, "tok_s": len(prompts) * E2E_OUT / elapsed, "first_outputs": first}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench engine")
    parser.add_argument("--skip-hf", action="store_true", help="skip transformers generate")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument(
        "--sweep", action="store_true", help="select the decode split policy first (floor.py)"
    )
    parser.add_argument(
        "--profile", default=None, help="folder for profile-decode.md and profile-mixed.md (step_profile.py)"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    ceil = ceilings()
    bw, tflops = ceil["copy_GBps"], ceil["gemm_TFLOPs"]
    print(json.dumps(ceil), flush=True)
    cfg = ModelConfig.from_dict(LLAMA3_8B, max_model_len=2048)
    folder = Path(tempfile.mkdtemp(prefix="llama3-8b-shape-"))
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))  # no weights on disk: random, in memory
    model = random_model(cfg, torch.device("cuda"), torch.bfloat16)
    weight_read, n_params = model_bytes(model)
    hf = None if args.skip_hf or args.skip_e2e else run_hf_generate(model, make_prompts(cfg))
    engine_cfg = EngineConfig(model=str(folder), max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192,
                              gpu_memory_utilization=0.85)  # fmt: skip
    t0 = time.perf_counter()
    runner = ModelRunner(engine_cfg, model=model, model_config=cfg)
    init_s = time.perf_counter() - t0
    rows, policy = [], None
    if args.sweep and hasattr(floor.attention, "set_decode_policy"):
        sweep, policy = floor.sweep_decode_policy(runner, bw, lambda d: print(json.dumps(d), flush=True))
        print(json.dumps({"policy": policy}), flush=True)
        floor.attention.set_decode_policy(**policy)
        rows += sweep
        sizes = runner.graphs.batch_sizes  # captured again under the selected policy
        runner.graphs = None
        gc.collect()
        runner._capture_graphs(sizes)
    rows += decode_rows(runner, cfg, bw, weight_read)
    rows += breakdown_rows(runner, weight_read, bw, tflops, n_params)
    rows += floor.attention_rows(runner, bw)
    for r in rows[-len(floor.ATTN_POINTS) :]:
        print(json.dumps(r), flush=True)
    rows += floor.mixed_rows(runner)
    sustained = floor.sustained_prefill(runner)
    print(json.dumps(rows[-6:] + [sustained]), flush=True)
    profiled = None
    if args.profile:
        from step_profile import profile_steps

        seqs = make_seqs(runner, 64, CTX)
        decode = ScheduledBatch([ScheduledChunk(s, CTX - 1, 1, True) for s in seqs])
        profiled = profile_steps(runner, decode, Path(args.profile))
        print(json.dumps(profiled), flush=True)
    floor_s = e2e_floor(cfg, n_params, bw, tflops, weight_read)
    ours = None if args.skip_e2e else run_engine_e2e(runner, engine_cfg)
    rows.append({"case": f"e2e {E2E_REQUESTS}x{E2E_IN}->{E2E_OUT} floor", "tok_s": E2E_REQUESTS * E2E_OUT / floor_s,
                 "seconds": floor_s})  # fmt: skip
    if ours:
        rows.append({"case": "e2e loraplane LLMEngine", "tok_s": ours["tok_s"], "seconds": ours["seconds"],
                     "x_floor": ours["seconds"] / floor_s})  # fmt: skip
    if hf:
        rows.append({"case": f"e2e transformers generate (batch {HF_BATCH})", "tok_s": hf["tok_s"],
                     "seconds": hf["seconds"], "x_floor": hf["seconds"] / floor_s})  # fmt: skip
    agree = None
    if ours and hf:
        a, b = ours["first_outputs"], hf["first_outputs"]
        agree = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)) / sum(
            len(r) for r in a
        )
    return {
        "title": "Engine: Llama-3-8B-shaped, random bf16 weights, one H200",
        "columns": [
            "case",
            "batch",
            "floor_ms",
            "graph_ms",
            "step_ms",
            "eager_ms",
            "x_floor",
            "step_x_floor",
            "tok_s",
            "seconds",
        ],  # fmt: skip
        "rows": rows,
        "meta": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "copy_GBps (read+write)": round(bw),
            "bf16 GEMM TFLOP/s (8192^3)": round(tflops),
            "weight bytes read per decode step": weight_read,
            "kv bytes per token": kv_bytes_per_token(cfg),
            "num_kv_blocks": runner.num_kv_blocks,
            "runner init s (profile + KV + graph capture)": round(init_s, 1),
            "greedy agreement ours vs transformers (first 4 requests, bf16, random weights)": agree,
            "e2e step timing (s)": None
            if ours is None
            else {k: round(v, 3) for k, v in ours["timing"].items()},
            "e2e per-step summary": None
            if ours is None
            else floor.e2e_summary(ours["steps"], ours["timing"]),
            "decode policy (selected by --sweep)": policy,
            "back-to-back 8192-token prefill steps (ms)": sustained,
            "profile (ms per step)": profiled,
        },
        "e2e_steps (kind, tokens, ms)": None if ours is None else ours["steps"],
        "notes": [
            "graph_ms: CUDA-graph forward (inputs copied in, logits out); step_ms: runner.execute (host input "
            "prep + forward + greedy sampling + host transfer); eager_ms: same forward without graphs.",
            "floor: (all weights but the embedding table + KV of the batch) / measured copy bandwidth.",
            "e2e floor: prefill FLOPs / measured GEMM rate + sum over decode steps of (weights + KV) / bandwidth.",
        ],
    }


def make_prompts(cfg: ModelConfig) -> list[list[int]]:
    gen = torch.Generator().manual_seed(E2E_REQUESTS)  # the same prompts make_seqs draws for the engine
    return [torch.randint(0, cfg.vocab_size, (E2E_IN,), generator=gen).tolist() for _ in range(E2E_REQUESTS)]
