"""Where a decode step's LoRA time goes, kernel by kernel, and which launch shapes shorten it.

The engine's layout on the Llama-3-8B shape (one pool per PEFT module, rank-1 pages, a captured B=64
metadata of rank bound 64), without the base model: each LoRA op of 32 layers captured in a CUDA graph
and timed for the decode cases of `main.py` (64 distinct r16, one adapter, 64 q,v-only r8, the mixed
batch), a torch.profiler table of one step's kernels, and a sweep of launch configs per op. Writes
DIR/probe.json (and prints one line per result).

    python bench/lora_decode/probe.py --out DIR [--budget-s 200] [--decode]   # src/ importable: scripts/device_env.sh

--decode: the decode-shaped kernels (kernels/triton_decode.py) beside the general ones: the whole step with
each, and the sweep over their block sizes instead of the general kernels' launch fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from loraplane.kernels import LoRABatchMeta, LoRAPool, ModuleSpec
from loraplane.kernels.launch_config import pick_config
from loraplane.kernels.triton_apply import lora_apply_pools_triton, lora_apply_triton

L, B, MAX_RANK = 32, 64, 64
SHAPES = {
    "q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
    "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096),
}  # fmt: skip
OPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
       "down": ("down_proj",)}  # fmt: skip
MIXED_RANKS = (8, 16, 32, 64)


def build_pools(dev) -> tuple[dict[str, LoRAPool], dict[str, list[int]]]:
    """Pools as the engine builds them; slots 0-63: r16 all modules, 64-127: q,v r8, 128-159: ranks 8-64."""
    rows = 64 * 16 + 64 * 8 + 8 * sum(MIXED_RANKS) + 64
    pools = {}
    for m, (i, o) in SHAPES.items():
        spec = {m: ModuleSpec(i, (o,))}
        page = LoRAPool.page_bytes_for(spec, L, 1, torch.bfloat16)
        p = LoRAPool(spec, L, rows * page, page_rank=1, max_rank=MAX_RANK, max_adapters=256,
                     dtype=torch.bfloat16, device=dev)  # fmt: skip
        for t in (*p.a.values(), *p.bt.values()):
            t.normal_(0, 0.02)
        pools[m] = p
    slots = {"d": [], "qv": [], "m": []}
    for s in range(64):
        for p in pools.values():
            p.allocate(16, 1.0, slot=s)
        slots["d"].append(s)
    for s in range(64, 128):
        for m in ("q_proj", "v_proj"):
            pools[m].allocate(8, 1.0, slot=s)
        slots["qv"].append(s)
    for i, s in enumerate(range(128, 160)):
        for p in pools.values():
            p.allocate(MIXED_RANKS[i % 4], 1.0, slot=s)
        slots["m"].append(s)
    for p in pools.values():  # allocate zeroes B rows: refill them
        for t in p.bt.values():
            t.normal_(0, 0.02)
    return pools, slots


def cases(slots) -> dict[str, list[tuple[int, int]]]:
    return {
        "d64": [(s, 1) for s in slots["d"]],
        "one": [(slots["d"][0], 1)] * B,
        "qv64": [(s, 1) for s in slots["qv"]],
        "mixed": [(-1, 1)] * 32 + [(s, 1) for s in slots["m"]],
    }


def ranks_of(pools) -> list[int]:
    hr = [p.host_ranks() for p in pools.values()]
    return [max(r[s] for r in hr) for s in range(len(hr[0]))]


class Step:
    """One op (or all four) over 32 layers, with per-op launch configs (None: the heuristic)."""

    def __init__(self, pools, meta, dev, ops=tuple(OPS), cfgs=None):
        self.pools, self.meta, self.ops, self.cfgs = pools, meta, ops, cfgs or {}
        self.x = {op: torch.randn(B, SHAPES[OPS[op][0]][0], device=dev, dtype=torch.bfloat16) for op in OPS}
        self.y = {op: torch.randn(B, sum(SHAPES[m][1] for m in OPS[op]), device=dev, dtype=torch.bfloat16)
                  for op in OPS}  # fmt: skip
        self.plans: dict = {}

    def cfg(self, op):
        mods = OPS[op]
        base = pick_config(self.meta, SHAPES[mods[0]][0], tuple(SHAPES[m][1] for m in mods), torch.bfloat16)
        over = self.cfgs.get(op)
        return over(base) if callable(over) else base

    def __call__(self):
        for layer in range(L):
            for op in self.ops:
                self.apply(op, layer)

    def apply(self, op, layer, base=None, side=None):
        """``base``/``side``: the base GEMM and the stream its shrink runs on beside it (triton_apply)."""
        mods, x, y, meta = OPS[op], self.x[op], self.y[op], self.meta
        cfg = self.cfg(op)
        key = (op, cfg)
        if len(mods) > 1:
            pools = tuple(self.pools[m] for m in mods)
            starts, c = [], 0
            for m in mods:
                starts.append(c)
                c += SHAPES[m][1]
            lora_apply_pools_triton(
                y, x, pools, mods, tuple(starts), layer, meta, cfg, self.plans, key, base, side
            )
        else:
            p = self.pools[mods[0]]
            tables = (p.page_table, p.ranks, p.scales, p.page_rank, p.max_rank)
            spec = p.modules[mods[0]]
            a, bt = p.a[(layer, mods[0])], p.bt[(layer, mods[0])]
            lora_apply_triton(
                y,
                x,
                a,
                bt,
                tables,
                spec.out_dims,
                spec.slice_starts,
                meta,
                cfg,
                self.plans,
                key,
                None,
                base,
                side,
            )


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def replay_ms(g, reps=25) -> float:
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def profile(g, meta, reqs, ranks) -> dict:
    """Kernel durations of one full-step replay, labelled by position in the layer (8 launches)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    meta.build(reqs, ranks)
    g.replay()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        g.replay()
        torch.cuda.synchronize()
    evs = sorted(
        (e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA and "kernel" in e.name),
        key=lambda e: e.time_range.start,
    )
    labels = [f"{k}_{op}" for op in OPS for k in ("shrink", "expand")]
    out: dict = {"n_kernels": len(evs)}
    if evs:
        span = (evs[-1].time_range.end - evs[0].time_range.start) / 1e3
        busy = sum(e.time_range.elapsed_us() for e in evs) / 1e3
        out.update(span_ms=span, busy_ms=busy)
        for i, e in enumerate(evs):
            lab = labels[i % 8] if len(evs) == 8 * L else e.name[:40]
            out.setdefault(lab, []).append(e.time_range.elapsed_us())
        for k, v in list(out.items()):
            if isinstance(v, list):
                out[k] = {"median_us": statistics.median(v), "n": len(v)}
    return out


def variants(op: str, base) -> list[tuple[str, object]]:
    """Launch-config variants of one op, one field at a time from the heuristic's, most telling first."""
    rep = dataclasses.replace
    out = [("default", None), ("block_r=16", lambda c: rep(c, block_r=16, shrink_block_r=16))]
    for s in sorted({max(1, base.split_k // 2), min(16, base.split_k * 2), 16} - {base.split_k}):
        out.append((f"split_k={s}", lambda c, s=s: rep(c, split_k=s)))
    for n in (256, 512, 1024, 2048):
        if n != base.n_chunk and n >= base.block_n:
            out.append((f"n_chunk={n}", lambda c, n=n: rep(c, n_chunk=n)))
    out += [
        ("warps=2", lambda c: rep(c, num_warps=2)),
        ("warps=8", lambda c: rep(c, num_warps=8)),
        ("block_n=128", lambda c: rep(c, block_n=128, n_chunk=max(128, c.n_chunk))),
        # Wider column tiles: more bytes of B in flight per iteration (a one-token tile moves 2 KB of a
        # r16 B^T per 64 columns), for the expands that stream at half the copy rate.
        ("block_n=256", lambda c: rep(c, block_n=256, n_chunk=max(256, c.n_chunk))),
        ("block_n=256 warps=8", lambda c: rep(c, block_n=256, n_chunk=max(256, c.n_chunk), num_warps=8)),
        ("block_n=512 warps=8", lambda c: rep(c, block_n=512, n_chunk=max(512, c.n_chunk), num_warps=8)),
        (
            "block_k=256" if base.block_k < 256 else "block_k=128",
            lambda c: rep(c, block_k=256 if c.block_k < 256 else 128),
        ),
        ("stages=2", lambda c: rep(c, num_stages=2)),
    ]
    if op in ("o", "down"):
        out += [(f"fused n_chunk={n}", lambda c, n=n: rep(c, fused=True, n_chunk=n)) for n in (512, 2048)]
    return out


# The decode kernels' block sizes: input columns per shrink program, output columns per expand program.
# (k, n, warps, dot): dot False takes every tile a token at a time. Wider blocks first: the expand's time
# grew with the warps it launched, not with the bytes each moved.
DECODE_BLOCKS = [
    (512, 512, 4, True), (512, 1024, 4, True), (1024, 1024, 4, True), (512, 1024, 2, True),
    (1024, 2048, 4, True), (2048, 1024, 4, True), (512, 512, 2, True), (1024, 1024, 8, True),
    (512, 1024, 4, False), (512, 256, 4, True),
]  # fmt: skip


def decode_cfg(k: int, n: int, dot: bool, warps: int = 4, pdl: bool = False):
    """A launch-config override: the decode kernels with blocks of k input and n output columns (``pdl``:
    launched with programmatic dependent launch)."""
    return lambda c: dataclasses.replace(c, decode=True, block_k=k, block_n=n, n_chunk=n, num_warps=warps,
                                         num_stages=1, decode_dot=dot, pdl=pdl)  # fmt: skip


def decode_variants() -> list[tuple[str, object]]:
    return [
        (f"decode k={k} n={n} w={w} dot={int(dot)}", decode_cfg(k, n, dot, w))
        for k, n, w, dot in DECODE_BLOCKS
    ]


def copy_gbs(dev) -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * n / (replay_ms(graph_of(lambda: dst.copy_(src)), 10) * 1e-3) / 1e9


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--decode", action="store_true", help="sweep the decode-shaped kernels' block sizes")
    ap.add_argument("--pdl", action="store_true", help="with --decode: the whole step with and without PDL")
    args = ap.parse_args(argv)
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "rows": []}

    def save(row=None):
        if row is not None:
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        (out / "probe.json").write_text(json.dumps(res, indent=1))

    pools, slots = build_pools(dev)
    ranks = ranks_of(pools)
    reqs = cases(slots)
    meta = LoRABatchMeta(B, dev, tile_m=16, capture=True, max_rank=MAX_RANK)
    meta.build(reqs["d64"], ranks)
    res["copy_gbs"] = copy_gbs(dev)
    save()

    def whole_step(kind: str, step: Step, prefix: str) -> None:
        """The whole LoRA step (4 ops x 32 layers) in one graph, per case, plus profiles of two cases."""
        g = graph_of(step)
        for case, r in reqs.items():
            meta.build(r, ranks)
            save({"kind": kind, "case": case, "ms": replay_ms(g)})
        for case in ("d64", "one"):
            try:
                res[f"{prefix}{case}"] = profile(g, meta, reqs[case], ranks)
            except Exception as e:  # noqa: BLE001 - the profile is a diagnostic
                res[f"{prefix}{case}"] = {"error": repr(e)}
            save()

    full = Step(pools, meta, dev)  # the heuristic's configs
    res["configs"] = {op: repr(full.cfg(op)) for op in OPS}
    whole_step("step", full, "profile_")
    if args.decode:  # the same step on the decode-shaped kernels, at the policy's default blocks
        from loraplane.kernels.launch_config import CapturePolicy

        pol = CapturePolicy(decode=True)
        kinds = [("step_decode", True, False), ("step_vector", False, False)]
        if args.pdl:  # first, beside the default, while the clocks are the same
            kinds.insert(1, ("step_decode_pdl", True, True))
        for kind, dot, pdl in kinds:
            dec = dict.fromkeys(OPS, decode_cfg(pol.decode_k, pol.decode_n, dot, pdl=pdl))
            whole_step(kind, Step(pools, meta, dev, cfgs=dec), f"profile_{kind}_")

    # Per op: each variant's 32-layer graph timed for every case, round-robin over the ops (variant i of
    # every op, then i + 1), until the time budget runs out.
    lists = {op: ([("default", None)] + decode_variants()) if args.decode else variants(op, full.cfg(op))
             for op in OPS}  # fmt: skip
    order = [
        (op, v) for i in range(max(map(len, lists.values()))) for op in OPS for v in lists[op][i : i + 1]
    ]
    for op, (name, over) in order:
        if time.time() - t_start > args.budget_s:
            res["stopped"] = f"budget at {op} {name}"
            save()
            break
        step = Step(pools, meta, dev, ops=(op,), cfgs={op: over})
        try:
            meta.build(reqs["d64"], ranks)
            gop = graph_of(step)
        except Exception as e:  # noqa: BLE001 - a variant may not compile (shared memory)
            save({"kind": "op", "op": op, "variant": name, "error": repr(e)[:200]})
            continue
        row = {"kind": "op", "op": op, "variant": name}
        for case, r in reqs.items():
            meta.build(r, ranks)
            row[case] = round(replay_ms(gop, 15) * 1e3 / L, 2)  # us per layer
        save(row)
        del gop
    res["wall_s"] = time.time() - t_start
    save()


if __name__ == "__main__":
    main()
