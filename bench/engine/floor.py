"""Engine benchmark parts measured against their floors: the paged decode kernel over batch x context (timed
inside CUDA graphs, so no host launch cost is counted), the split-policy selection, a step mixing prefill and
decode against the same prefill alone plus the same decode alone, and back-to-back prefill steps.

Works against any engine version that has ``attention.paged_decode`` (the policy calls are optional), so the
same file measures the code before and after a change in one device run.
"""

from __future__ import annotations

import statistics
import time

import torch

from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk
from loraplane.engine.core.sequence import SamplingParams, Sequence
from loraplane.engine.model import attention

# (batch, context) points of the decode kernel; batch x context stays under one layer's cache (~850k tokens)
ATTN_POINTS = [(1, 512), (1, 8192), (4, 2048), (16, 512), (16, 2048), (16, 8192), (64, 512), (64, 2048),
               (64, 8192), (128, 512), (128, 4096), (256, 512), (256, 2048)]  # fmt: skip
LAUNCHES = [(64, 4, 2), (64, 4, 3), (32, 4, 3)]  # (block_n, warps, stages)
SPLITS = (1, 2, 4, 8, 16)
GRAPH_REPS = 8  # launches per captured graph, each on another layer's cache (no L2 reuse between launches)


def graph_ms(fns, iters: int = 5) -> float:
    """Median time of one call, the calls captured back to back in a CUDA graph (fns: one callable per rep)."""
    for fn in fns[:2]:
        fn()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    return statistics.median(times)


def _attn_case(runner, B: int, ctx: int):
    cfg = runner.model_config
    per = -(-ctx // runner.block_size)
    gen = torch.Generator().manual_seed(B * 7919 + ctx)
    blocks = torch.randperm(runner.num_kv_blocks, generator=gen)[: B * per]  # scattered pages, as in serving
    tables = blocks.to(torch.int32).view(B, per).cuda()
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(B, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    return q, tables, lens


def _time_decode(runner, B: int, ctx: int, **launch) -> float:
    q, tables, lens = _attn_case(runner, B, ctx)
    layers = runner.model.model.layers
    out = torch.empty_like(q)
    fns = [
        lambda a=layers[i % len(layers)].self_attn: attention.paged_decode(
            q, a.k_cache, a.v_cache, tables, lens, 0.088, out, **launch
        )
        for i in range(GRAPH_REPS)
    ]
    return graph_ms(fns)


def kv_floor_ms(runner, B: int, ctx: int, bw: float) -> float:
    cfg = runner.model_config
    return B * ctx * 2 * cfg.num_kv_heads * cfg.head_dim * 2 / bw / 1e6


def sweep_decode_policy(runner, bw: float, log) -> tuple[list[dict], dict]:
    """Every launch shape x split count at every point; picks the launch shape (geometric mean over B >= 16 of
    the best time) and, for it, each batch's split count (mean x floor over its contexts)."""
    times: dict[tuple, float] = {}
    for launch in LAUNCHES:
        block_n, warps, stages = launch
        for B, ctx in ATTN_POINTS:
            for splits in SPLITS:
                ms = _time_decode(runner, B, ctx, block_n=block_n, num_warps=warps, num_stages=stages,
                                  num_splits=splits)  # fmt: skip
                times[(launch, B, ctx, splits)] = ms
            best = min(SPLITS, key=lambda s, la=launch, b=B, c=ctx: times[(la, b, c, s)])
            log({"sweep": launch, "B": B, "ctx": ctx, "best_splits": best,
                 "x_floor": {s: round(times[(launch, B, ctx, s)] / kv_floor_ms(runner, B, ctx, bw), 2)
                             for s in SPLITS}})  # fmt: skip

    def score(launch) -> float:
        logs = [
            min(times[(launch, B, ctx, s)] for s in SPLITS) / kv_floor_ms(runner, B, ctx, bw)
            for B, ctx in ATTN_POINTS
            if B >= 16
        ]
        return statistics.geometric_mean(logs)

    launch = min(LAUNCHES, key=score)
    table = []
    for B in sorted({b for b, _ in ATTN_POINTS}):
        ctxs = [c for b, c in ATTN_POINTS if b == B]
        best = min(
            SPLITS,
            key=lambda s, b=B, cs=ctxs: statistics.mean(
                times[(launch, b, c, s)] / kv_floor_ms(runner, b, c, bw) for c in cs
            ),
        )
        table.append((0 if not table else B * runner.model_config.num_kv_heads, best))
    policy = {"splits": tuple(table), "block_n": launch[0], "num_warps": launch[1], "num_stages": launch[2]}
    rows = [
        {"case": f"sweep launch block_n={la[0]} warps={la[1]} stages={la[2]}", "x_floor": score(la)}
        for la in LAUNCHES
    ]
    return rows, policy


def attention_rows(runner, bw: float) -> list[dict]:
    """The decode kernel with the engine's own policy (no launch arguments) at every point, in CUDA graphs."""
    rows = []
    for B, ctx in ATTN_POINTS:
        floor = kv_floor_ms(runner, B, ctx, bw)
        ms = _time_decode(runner, B, ctx)
        splits = attention.default_num_splits(B, runner.model_config.num_kv_heads)
        rows.append({"case": f"attn B={B} ctx={ctx} (policy: {splits} splits)", "batch": B, "floor_ms": floor,
                     "graph_ms": ms, "x_floor": ms / floor})  # fmt: skip
    return rows


def _seq(runner, n_tokens: int, first_block: int, seed: int) -> Sequence:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.vocab_size, (n_tokens,), generator=gen).tolist()
    seq = Sequence(ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    per = -(-(n_tokens + 1) // runner.block_size)
    seq.block_table = list(range(first_block, first_block + per))
    return seq


def mixed_batches(runner, num_decode: int, budget: int = 8192, prompt: int = 512):
    """(mixed, prefill part, decode part) shaped like a serving step: decode rows first, one continued prompt
    (second half), fresh prompts, and a partial fresh prompt filling the token budget."""
    per = -(-(prompt + 1) // runner.block_size)
    block, seed = 8000, 0
    decode, prefill = [], []
    for _ in range(num_decode):
        s = _seq(runner, prompt, block, seed)
        decode.append(ScheduledChunk(s, prompt - 1, 1, True))
        block, seed = block + per, seed + 1
    left = budget - num_decode
    s = _seq(runner, prompt, block, seed)
    prefill.append(ScheduledChunk(s, prompt // 2, prompt // 2, True))
    left -= prompt // 2
    while left > 0:
        block, seed = block + per, seed + 1
        n = min(prompt, left)
        prefill.append(ScheduledChunk(_seq(runner, prompt, block, seed), 0, n, n == prompt))
        left -= n
    return ScheduledBatch(decode + prefill), ScheduledBatch(prefill), ScheduledBatch(decode)


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def mixed_rows(runner, rounds: int = 3) -> list[dict]:
    """Target: a mixed step takes no longer than its prefill alone plus its decode alone (each as the engine
    runs it: runner.execute, decode-only steps through CUDA graphs). The three are timed in turn, rounds times."""
    rows = []
    for num_decode in (64, 240):
        mixed, prefill, decode = mixed_batches(runner, num_decode)
        for b in (mixed, prefill, decode):
            runner.execute(b)  # warm
        t = {"mixed": [], "prefill": [], "decode": []}
        for _ in range(rounds):
            for name, b in (("mixed", mixed), ("prefill", prefill), ("decode", decode)):
                t[name].append(wall_ms(lambda b=b: runner.execute(b)))
        m, p, d = (statistics.median(t[k]) for k in ("mixed", "prefill", "decode"))
        rows += [
            {"case": f"prefill alone ({prefill.num_tokens} tok, 1 continued prompt)", "step_ms": p},
            {"case": f"decode alone B={num_decode} ctx 512", "batch": num_decode, "step_ms": d},
            {"case": f"mixed step: both at once ({mixed.num_tokens} tok) vs prefill + decode alone",
             "batch": num_decode, "step_ms": m, "floor_ms": p + d, "x_floor": m / (p + d)},
        ]  # fmt: skip
    return rows


def sustained_prefill(runner, steps: int = 10) -> dict:
    """Back-to-back pure 8192-token prefill steps: does the step slow down as the GPU stays loaded?"""
    _, prefill, _ = mixed_batches(runner, 0)
    runner.execute(prefill)
    ms = [wall_ms(lambda: runner.execute(prefill)) for _ in range(steps)]
    return {"first": round(ms[0], 1), "median": round(statistics.median(ms), 1), "last": round(ms[-1], 1),
            "max": round(max(ms), 1)}  # fmt: skip


def e2e_summary(steps: list, timing: dict) -> dict:
    """Per-step view of the end-to-end run: pure prefills, mixed steps, decode steps (ms)."""
    mixed = [ms for kind, tok, ms in steps if kind == "mixed"]
    dec = [ms for kind, tok, ms in steps if kind == "decode"]
    out = {"mixed_steps": len(mixed), "decode_steps": len(dec)}
    if mixed:
        out |= {"mixed_median_ms": statistics.median(mixed), "mixed_max_ms": max(mixed)}
    if dec:
        out |= {"decode_median_ms": statistics.median(dec), "decode_sum_s": round(sum(dec) / 1e3, 3)}
    out["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries")
    return out | {"host_outside_steps_s": round(timing.get("engine_overhead_s", 0.0), 3)}
