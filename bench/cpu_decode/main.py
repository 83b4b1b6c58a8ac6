"""Single-stream CPU decode: the engine against transformers' ``generate`` on the demo model, side by side.

Same machine, same converted SmolLM2-135M-Instruct folder, same dtype (fp32, the engine's CPU default), same
chat-templated prompt, greedy, 128 new tokens (EOS ignored so both produce exactly 128). Each repeat runs the
engine then transformers back to back, so a noisy neighbour hits both; the table reports the median and the
spread over repeats. Decode tok/s = (new tokens - 1) / (time from the first to the last new token), so the
prefill is left out; TTFT is reported on its own.

    nice -n 10 .venv/bin/python bench/run.py cpu_decode --out bench/cpu_decode/results [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run.py cpu_decode")
    p.add_argument("--model-dir", help="converted demo folder (default: the demo model cache)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--profile", action="store_true", help="also profile one engine run (torch.profiler)")
    p.add_argument(
        "--with-before",
        action="store_true",
        help="add a row for the engine with its previous CPU gathers (indexed K/V, cos/sin; masked KV stores)",
    )
    return p.parse_args(argv)


class _Stamps:
    """A transformers streamer that timestamps every new token (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.extend(int(t) for t in value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def _summary(t0: float, stamps: list[float]) -> dict:
    n = len(stamps)
    return {
        "new_tokens": n,
        "ttft_ms": (stamps[0] - t0) * 1e3,
        "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]),
        "total_s": stamps[-1] - t0,
    }


def run_engine(engine, prompt_ids: list[int], new_tokens: int) -> tuple[dict, list[int]]:
    from loraplane.engine.core.sequence import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    seq = engine.add_request(prompt_ids, sampling)
    stamps = []
    while engine.has_unfinished():
        for out in engine.step():
            stamps.extend(time.perf_counter() for _ in out.new_token_ids)
    return _summary(t0, stamps), list(seq.output_token_ids)


@torch.inference_mode()
def run_hf(model, prompt_ids: list[int], new_tokens: int) -> tuple[dict, list[int]]:
    ids = torch.tensor([prompt_ids])
    streamer = _Stamps()
    t0 = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=streamer,
        pad_token_id=model.config.eos_token_id,
    )
    return _summary(t0, streamer.times), streamer.tokens


def _prefill_before(q, k, v, k_cache, v_cache, meta, scale, out) -> None:
    """The engine's CPU context gather before index_select: advanced indexing, twice per layer."""
    from loraplane.engine.model.attention import _sdpa_span

    H, D = k.shape[1], k.shape[2]
    k_ctx = v_ctx = None
    if meta.gather_slots is not None and meta.gather_slots.numel():
        k_ctx = k_cache.view(-1, H, D)[meta.gather_slots]
        v_ctx = v_cache.view(-1, H, D)[meta.gather_slots]
    for s in meta.prefill:
        rows = slice(s.q_start, s.q_start + s.q_len)
        if s.gather_start < 0:
            ks, vs = k[rows], v[rows]
        else:
            ctx = slice(s.gather_start, s.gather_start + s.ctx_len)
            ks, vs = k_ctx[ctx], v_ctx[ctx]
        out[rows] = _sdpa_span(q[rows], ks, vs, scale)


def _rope_and_store_before(qkv, num_q, num_kv, positions, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """The engine's CPU rope + KV store before index_select: indexed cos/sin, a boolean mask on every store."""
    c = cos[positions].to(qkv.dtype)[:, None, :].repeat(1, 1, 2)
    s = sin[positions].to(qkv.dtype)[:, None, :].repeat(1, 1, 2)
    qk = qkv[:, : num_q + num_kv]
    half = qk.shape[-1] // 2
    qk.copy_(qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s)
    if k_cache.numel() > 0:
        keep = slot_mapping >= 0
        slots, k, v = slot_mapping[keep], qkv[keep, num_q : num_q + num_kv], qkv[keep, num_q + num_kv :]
        k_cache.view(-1, num_kv, qkv.shape[-1]).index_copy_(0, slots, k)
        v_cache.view(-1, num_kv, qkv.shape[-1]).index_copy_(0, slots, v)


def run_engine_before(engine, prompt_ids: list[int], new_tokens: int) -> tuple[dict, list[int]]:
    from loraplane.engine import attention, model

    current = attention._prefill, model.rope_and_store_kv
    attention._prefill, model.rope_and_store_kv = _prefill_before, _rope_and_store_before
    try:
        return run_engine(engine, prompt_ids, new_tokens)
    finally:
        attention._prefill, model.rope_and_store_kv = current


def profile_engine(engine, prompt_ids: list[int], new_tokens: int, top: int = 15) -> list[dict]:
    """Top CPU ops (self time) of one engine decode run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_engine(engine, prompt_ids, new_tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_ms": round(e.self_cpu_time_total / 1e3, 1),
            "share": round(e.self_cpu_time_total / total, 3),
        }
        for e in events[:top]
    ]


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(argv: list[str]) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplane.engine.core.config import EngineConfig
    from loraplane.engine.core.llm_engine import LLMEngine
    from loraplane.engine.model.demo_model import ensure_demo_model

    model_dir = str(ensure_demo_model(args.model_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    engine = LLMEngine(EngineConfig(model=model_dir, device="cpu", dtype=args.dtype))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()

    run_engine(engine, prompt_ids, 8)  # warm-up both (allocator, oneDNN primitives)
    run_hf(hf, prompt_ids, 8)
    runners = {"engine": lambda: run_engine(engine, prompt_ids, args.new_tokens)}
    if args.with_before:
        runners["engine, gathers before"] = lambda: run_engine_before(engine, prompt_ids, args.new_tokens)
    runners["transformers"] = lambda: run_hf(hf, prompt_ids, args.new_tokens)
    results: dict[str, list[dict]] = {name: [] for name in runners}
    outputs = {}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            stats, outputs[name] = runner()
            results[name].append(stats)
    same = sum(a == b for a, b in zip(outputs["engine"], outputs["transformers"], strict=False))
    first_diff = next(
        (
            i
            for i, (a, b) in enumerate(zip(outputs["engine"], outputs["transformers"], strict=False))
            if a != b
        ),
        None,
    )

    rows = []
    for name, runs in results.items():
        tok_s = _spread([r["decode_tok_s"] for r in runs])
        ttft = _spread([r["ttft_ms"] for r in runs])
        rows.append(
            {
                "implementation": name,
                "decode tok/s (median)": tok_s["median"],
                "min": tok_s["min"],
                "max": tok_s["max"],
                "TTFT ms (median)": ttft["median"],
                "new tokens": runs[0]["new_tokens"],
            }
        )
    ratios = [
        e["decode_tok_s"] / h["decode_tok_s"]
        for e, h in zip(results["engine"], results["transformers"], strict=True)
    ]
    ratio = _spread(ratios)
    best = max(r["decode_tok_s"] for r in results["engine"]) / max(
        r["decode_tok_s"] for r in results["transformers"]
    )
    load = os.getloadavg()
    result = {
        "title": f"Single-stream CPU decode, SmolLM2-135M-Instruct {args.dtype}, greedy, {args.new_tokens} new tokens",
        "columns": [
            "implementation",
            "decode tok/s (median)",
            "min",
            "max",
            "TTFT ms (median)",
            "new tokens",
        ],
        "rows": rows,
        "meta": {
            "prompt": f"chat template of {PROMPT!r} ({len(prompt_ids)} tokens)",
            "threads": args.threads,
            "repeats": args.repeats,
            "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__,
            "load average after (1/5/15 min)": " / ".join(f"{x:.1f}" for x in load),
            "engine / transformers decode ratio, per repeat": (
                f"median {ratio['median']:.2f}, min {ratio['min']:.2f}, max {ratio['max']:.2f}"
            ),
            "engine / transformers, best repeat of each (the least disturbed)": f"{best:.2f}",
            "identical greedy tokens": f"{same}/{args.new_tokens} (first difference at {first_diff})",
        },
        "runs": results,
        "notes": [
            "Each repeat runs the engine then transformers back to back; the per-repeat ratio cancels most of "
            "the noise of a shared machine.",
        ],
    }
    if args.profile:
        result["engine_profile_top_ops"] = profile_engine(engine, prompt_ids, args.new_tokens)
    return result
