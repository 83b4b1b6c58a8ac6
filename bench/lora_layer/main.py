"""One decoder layer's LoRA work in the engine's layout, before/after: host time and GPU time.

``python bench/run.py lora_layer --out DIR [--baseline KERNELS_DIR] [--layers 8]``

Layout as in the engine: one single-slice pool per PEFT module (q, k, v, o, gate, up, down; Llama-3-8B
shapes, bf16, rank-1 pages), one slot numbering, one batch metadata per step. Each side runs a layer as
the engine's ``LoRALinear`` does: this tree with ``lora_apply_many`` for q,k,v and gate,up and
``lora_apply`` for o and down; the baseline (a src/loraplane/kernels/ folder, e.g. the main branch's) with one
``lora_apply`` per module.

- host: eager, ``--layers`` layers per timed pass, the Python time per layer until every launch is
  queued (no sync inside; the GPU is idle at the start of each pass), and the wall time with the sync.
- graph: all layers captured in one CUDA graph (capture metadata, capacity 64), median replay time per
  layer, next to the base GEMMs of the four projections at the same T, also graph-replayed.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from pathlib import Path

import torch

from loraplane.kernels import LoRABatchMeta, LoRAPool, ModuleSpec, lora_apply, lora_apply_many

HID, KV, FF = 4096, 1024, 14336
MODULES = {"q": (HID, HID), "k": (HID, KV), "v": (HID, KV), "o": (HID, HID), "gate": (HID, FF),
           "up": (HID, FF), "down": (FF, HID)}  # fmt: skip
PROJ = [("qkv", ("q", "k", "v")), ("o", ("o",)), ("gate_up", ("gate", "up")), ("down", ("down",))]
DT = torch.bfloat16
COLUMNS = ["section", "case", "T", "n", "before_us", "after_us", "after/before", "base_gemm_us",
           "lora/base_before", "lora/base_after", "max_diff"]  # fmt: skip


def _pools(layers: int, n_adapters: int, rank: int):
    pools = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, (fi, fo) in MODULES.items():
        spec = {m: ModuleSpec(fi, (fo,))}
        budget = (n_adapters * rank + 8) * LoRAPool.page_bytes_for(spec, layers, 1, DT)
        pools[m] = LoRAPool(spec, layers, budget, page_rank=1, max_rank=rank, max_adapters=n_adapters + 4,
                            dtype=DT, device="cuda")  # fmt: skip
        for slot in range(n_adapters):  # allocation zeroes B rows: fill after it
            pools[m].allocate(rank, 1.0, slot=slot)
        for layer in range(layers):
            pools[m].a[(layer, m)].normal_(generator=g).mul_(fi**-0.5)
            pools[m].bt[(layer, m)].normal_(generator=g).mul_(rank**-0.5)
    ranks = [rank] * n_adapters
    return pools, ranks


def _layer_fn(pools, meta, xs, ys, old_ops, layer: int):
    def new():
        for name, members in PROJ:
            x, y = xs[name], ys[name]
            if len(members) > 1:
                targets, c = [], 0
                for m in members:
                    targets.append((pools[m], m, c))
                    c += MODULES[m][1]
                lora_apply_many(y, x, targets, layer, meta)
            else:
                lora_apply(y, x, pools[members[0]], layer, members[0], meta)

    def old():
        for name, members in PROJ:
            x, y, c = xs[name], ys[name], 0
            for m in members:
                w = MODULES[m][1]
                old_ops.lora_apply(y[:, c : c + w], x, pools[m], layer, m, meta)
                c += w

    return new, old


def _io(T: int):
    xs, ys = {}, {}
    for name, members in PROJ:
        fi = MODULES[members[0]][0]
        xs[name] = torch.randn(T, fi, device="cuda", dtype=DT)
        ys[name] = torch.randn(T, sum(MODULES[m][1] for m in members), device="cuda", dtype=DT)
    return xs, ys


def _host(pools, ranks, old_ops, layers: int, T: int, n: int, tile_m: int) -> dict:
    if tile_m == 16:  # decode: T sequences of one token, n distinct adapters
        reqs = [(i % n, 1) for i in range(T)]
    else:  # prefill: n prompts of T / n tokens
        reqs = [(i, T // n) for i in range(n)]
    xs, ys = _io(T)
    out = {}
    for side in ("after", "before", "after", "before"):
        meta = LoRABatchMeta(T, "cuda", tile_m=tile_m).build(reqs, ranks)
        fns = [
            _layer_fn(pools, meta, xs, ys, old_ops, layer)[0 if side == "after" else 1]
            for layer in range(layers)
        ]
        for f in fns:  # compile, and the first layer of the step builds the launch shapes
            f()
        torch.cuda.synchronize()
        hosts, walls = [], []
        for _ in range(10):
            meta.build(reqs, ranks)  # a new step: launch shapes are worked out again on its first layer
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for f in fns:
                f()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            hosts.append((t1 - t0) / layers * 1e6)
            walls.append((time.perf_counter() - t0) / layers * 1e6)
        out.setdefault(side, []).append((statistics.median(hosts), statistics.median(walls)))
    return {k: min(v) for k, v in out.items()}


def _graph_us(fn, reps: int = 20) -> float:
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(times)


def _graph(pools, ranks, old_ops, layers: int, T: int, n: int, weights) -> dict:
    reqs = [(i % n, 1) for i in range(T)]
    meta = LoRABatchMeta(64, "cuda", tile_m=16, capture=True, max_rank=max(ranks))
    meta.build(reqs, ranks)
    xs, ys = _io(T)
    y0 = {k: v.clone() for k, v in ys.items()}  # replays keep adding into ys: restore before each delta
    res = {}
    outs = {}
    for side in ("after", "before"):
        fns = [
            _layer_fn(pools, meta, xs, ys, old_ops, layer)[0 if side == "after" else 1]
            for layer in range(layers)
        ]
        for k in ys:
            ys[k].copy_(y0[k])
        for f in fns[:1]:
            f()
        outs[side] = {k: (ys[k].float() - y0[k].float()) for k in ys}

        def step(fns=fns):
            for f in fns:
                f()

        res[side] = min(_graph_us(step) for _ in range(3)) / layers
    diff = max(
        ((outs["after"][k] - outs["before"][k]).abs().max() / outs["before"][k].abs().max()).item()
        for k in ys
    )

    def base():
        for name, _ in PROJ:
            torch.matmul(xs[name], weights[name].t())

    res["base"] = _graph_us(base)
    res["diff"] = diff
    return res


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="bench lora_layer")
    p.add_argument("--baseline", default="kernels", help="src/loraplane/kernels/ folder of the 'before' side")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sections", default="host,graph", help="comma-separated: host, graph")
    args = p.parse_args(argv)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))
    from ab import load_baseline

    load_baseline(args.baseline)
    old_ops = importlib.import_module("kernels_baseline.ops")
    torch.manual_seed(0)
    pools, ranks = _pools(args.layers, 64, 16)
    weights = {name: torch.randn(sum(MODULES[m][1] for m in members), MODULES[members[0]][0], device="cuda",
                                 dtype=DT) * 0.01 for name, members in PROJ}  # fmt: skip
    rows = []
    sections = args.sections.split(",")
    for label, T, n, tile_m in (
        ("eager prefill", 256, 4, 64),
        ("eager decode", 64, 64, 16),
        ("eager decode", 64, 1, 16),
    ):
        if "host" not in sections:
            break
        h = _host(pools, ranks, old_ops, args.layers, T, n, tile_m)
        for i, what in enumerate(("host", "wall")):
            b, a = h["before"][i], h["after"][i]
            rows.append({"section": f"{what} per layer", "case": label, "T": T, "n": n, "before_us": b,
                         "after_us": a, "after/before": a / b})  # fmt: skip
            print(rows[-1], flush=True)
    for T, n in ((64, 1), (64, 8), (64, 64), (1, 1), (16, 16)):
        if "graph" not in sections:
            break
        g = _graph(pools, ranks[:n], old_ops, args.layers, T, n, weights)
        rows.append({"section": "graph per layer", "case": "decode (4 projections)", "T": T, "n": n,
                     "before_us": g["before"], "after_us": g["after"], "after/before": g["after"] / g["before"],
                     "base_gemm_us": g["base"], "lora/base_before": g["before"] / g["base"],
                     "lora/base_after": g["after"] / g["base"], "max_diff": g["diff"]})  # fmt: skip
        print(rows[-1], flush=True)
    return {
        "title": "One layer's LoRA work, engine layout (pool per module), Llama-3-8B shapes, r16, H200",
        "columns": COLUMNS,
        "rows": rows,
        "meta": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "layers": args.layers,
            "baseline": args.baseline,
        },  # fmt: skip
        "notes": [
            "host: Python time per layer until all of its launches are queued (eager; no sync); wall: the same "
            "pass until the GPU is done, per layer. Each pass starts a new step (metadata rebuilt).",
            "graph: every layer in one CUDA graph, median replay / layers; base_gemm_us: the four projections' "
            "GEMMs (x @ W^T) at the same T, graph-replayed. max_diff: largest |after - before| of the LoRA delta "
            "over the largest |before| delta, first layer.",
        ],
    }
