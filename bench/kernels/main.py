"""Multi-LoRA shrink+expand on Llama-3-8B projection shapes (bf16, CUDA graphs, L2 flushed).

Run through the runner: ``python bench/run.py kernels --out DIR [--quick] [--sweep] [--plot FILE]``;
``--ab BASELINE`` times a baseline src/loraplane/kernels/ tree against this one instead (ab.py).
Every case: a pool of 128 resident adapters, n of them active; the timed unit is one ``lora_apply``
(shrink + expand) replayed from a CUDA graph, median of ``triton.testing.do_bench``, rotating among 4
input sets. The floor is (x read once + each active adapter's A and B once + y read and written once)
over the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import runpy
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from loraplane.kernels import LoRABatchMeta, LoRAPool, ModuleSpec, lora_apply
from loraplane.kernels.triton_ops import pick_config

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/kernels: report.py
from report import case_line, plot, summarize  # noqa: E402

SHAPES = {
    "q_proj": ModuleSpec(4096, (4096,)),  # o_proj is the same 4096->4096 shape: measured once, here
    "qkv": ModuleSpec(4096, (4096, 1024, 1024)),
    "gate_up": ModuleSpec(4096, (14336, 14336)),
    "down": ModuleSpec(14336, (4096,)),
}
RANKS = {"r16": (16,), "r64": (64,), "mix8/64": (8, 64)}
DECODE_T, PREFILL_T, NS = (1, 16, 64, 256), (2048, 8192), (1, 8, 32, 64, 128)
RESIDENT, SEGMENT, SETS = 128, 512, 4
DT = torch.bfloat16
COLUMNS = [
    "shape", "rank", "phase", "T", "n", "us", "floor_us", "x_floor", "target_us", "ok",
    "base_us", "lora/base", "bmm_us", "loop_us", "err",
]  # fmt: skip


def _graphed(fns) -> float:
    """Median microseconds of one replay, rotating over one captured graph per callable."""
    graphs = []
    for fn in fns:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    state = [0]

    def replay():
        graphs[state[0] % len(graphs)].replay()
        state[0] += 1

    return do_bench(replay, warmup=5, rep=25, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted)."""
    src = torch.randn(1 << 30, dtype=DT, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


@dataclasses.dataclass
class Bank:
    """One pool with 128 resident adapters for one (shape, rank mix), plus dense copies for baselines."""

    spec: ModuleSpec
    pool: LoRAPool
    slots: list[int]
    a_dense: torch.Tensor  # [slots, S, Rmax, K]
    bt_dense: torch.Tensor  # [slots, Rmax, N]
    scales: torch.Tensor  # [slots] float32


def make_bank(spec: ModuleSpec, ranks: tuple[int, ...], resident: int) -> Bank:
    rank_list = [ranks[i % len(ranks)] for i in range(resident)]
    page = LoRAPool.page_bytes_for({"m": spec}, 1, 8, DT)
    budget = sum(-(-r // 8) for r in rank_list) * page
    pool = LoRAPool({"m": spec}, 1, budget, page_rank=8, max_rank=128, dtype=DT, device="cuda")
    slots = [pool.allocate(r, 2.0 / r**0.5) for r in rank_list]
    a, bt = pool.a[(0, "m")], pool.bt[(0, "m")]
    a.normal_(0, spec.in_dim**-0.5)
    bt.normal_(0, 0.125)
    rmax = max(ranks)
    a_dense = torch.zeros(resident, spec.num_slices, rmax, spec.in_dim, dtype=DT, device="cuda")
    bt_dense = torch.zeros(resident, rmax, spec.out_total, dtype=DT, device="cuda")
    for i, slot in enumerate(slots):
        rows = pool.rows_of(slot)
        a_dense[i, :, : rows.numel()] = a[:, rows]
        bt_dense[i, : rows.numel()] = bt[rows]
    scales = torch.tensor([pool.scale_of(s) for s in slots], dtype=torch.float32, device="cuda")
    return Bank(spec, pool, slots, a_dense, bt_dense, scales)


def case_requests(phase: str, T: int, n: int) -> list[tuple[int, int]]:
    """Adapter index (into bank.slots) and token count per request."""
    if phase == "decode":
        return [(i % n, 1) for i in range(T)]
    return [(i % n, SEGMENT) for i in range(T // SEGMENT)]


def floor_bytes(bank: Bank, reqs, T: int) -> int:
    spec, elem = bank.spec, 2
    active = {a for a, _ in reqs}
    ab = sum(bank.pool.rank_of(bank.slots[a]) * spec.row_elems() for a in active)
    return elem * (T * spec.in_dim + ab + 2 * T * spec.out_total)


def io_sets(spec: ModuleSpec, T: int, k: int):
    return [
        (
            torch.randn(T, spec.in_dim, dtype=DT, device="cuda"),
            torch.randn(T, spec.out_total, dtype=DT, device="cuda"),
        )
        for _ in range(k)
    ]


def bmm_fn(bank: Bank, tok: torch.Tensor, x, y):
    """Gathered-bmm baseline (padded to the bank's max rank): gather each token's A and B, batched matmul."""
    starts = bank.spec.out_starts
    sc = bank.scales[tok][:, None]

    def fn():
        v = torch.einsum("tk,tsrk->tsr", x, bank.a_dense[tok])  # [T, S, R]
        bg = bank.bt_dense[tok]  # [T, R, N]
        for s in range(bank.spec.num_slices):
            c0, c1 = starts[s], starts[s + 1]
            y[:, c0:c1] += (sc * torch.bmm(v[:, s : s + 1], bg[:, :, c0:c1]).squeeze(1)).to(DT)

    return fn


def loop_fn(bank: Bank, groups, x, y):
    """Per-adapter loop baseline: for each active adapter, gather its rows and run two matmuls."""
    starts = bank.spec.out_starts

    def fn():
        for a, idx, r, scale in groups:
            xa = x.index_select(0, idx)
            d = torch.cat(
                [
                    (xa @ bank.a_dense[a, s, :r].t()) @ bank.bt_dense[a, :r, starts[s] : starts[s + 1]]
                    for s in range(bank.spec.num_slices)
                ],
                1,
            )
            y.index_add_(0, idx, d, alpha=scale)

    return fn


def run_case(
    bank: Bank, phase: str, T: int, n: int, bw: float, base_us: float, baselines: bool, cfg=None
) -> dict:
    spec = bank.spec
    reqs = case_requests(phase, T, n)
    slot_reqs = [(bank.slots[a], c) for a, c in reqs]
    capture = phase == "decode"
    # A captured decode graph is specialized to the pool's highest rank (re-captured when it grows).
    meta = LoRABatchMeta(
        T, "cuda", tile_m=16 if capture else 64, capture=capture, max_rank=max(bank.pool.host_ranks())
    )
    meta.build(slot_reqs, bank.pool.host_ranks())
    sets = io_sets(spec, T, SETS)
    # Correctness at full scale: one apply against the per-adapter loop in float32.
    x, y = sets[0]
    y_ref = y.float().clone()
    groups = []
    for slot, idx in meta.groups:
        a = bank.slots.index(slot)
        groups.append((a, idx.to(x.device), bank.pool.rank_of(slot), bank.pool.scale_of(slot)))
    for a, idx, r, scale in groups:
        xa = x.float().index_select(0, idx)
        d = torch.cat(
            [
                (xa @ bank.a_dense[a, s, :r].float().t()) @ bank.bt_dense[a, :r, c0:c1].float()
                for s, (c0, c1) in enumerate(zip(spec.out_starts, spec.out_starts[1:], strict=False))
            ],
            1,
        )
        y_ref.index_add_(0, idx, d * scale)
    y_out = y.clone()
    lora_apply(y_out, x, bank.pool, 0, "m", meta, config=cfg)
    err = ((y_out.float() - y_ref).norm() / (y_ref - y.float()).norm()).item()
    if not err < 5e-2:
        raise AssertionError(f"{spec} {phase} T={T} n={n}: rel err {err:.2e} against the per-adapter loop")
    us = _graphed([lambda x=x, y=y: lora_apply(y, x, bank.pool, 0, "m", meta, config=cfg) for x, y in sets])
    floor = floor_bytes(bank, reqs, T) / bw * 1e6
    target = max(2 * floor, 8.0) if capture else 1.5 * floor
    row = dict(
        shape=None, rank=None, phase=phase, T=T, n=len(groups), us=us, floor_us=floor, x_floor=us / floor,
        target_us=target, ok=us <= target, base_us=base_us, **{"lora/base": us / base_us}, err=err,
        bmm_us=None, loop_us=None, resident=len(bank.slots), active_rank_sum=sum(g[2] for g in groups),
    )  # fmt: skip
    if baselines:
        if capture:
            tok = torch.tensor([bank.slots.index(s) for s, c in slot_reqs for _ in range(c)], device="cuda")
            row["bmm_us"] = _graphed([bmm_fn(bank, tok, x, y) for x, y in sets[:2]])
        row["loop_us"] = _graphed([loop_fn(bank, groups, x, y) for x, y in sets[:2]])
    return row


def base_gemm_us(spec: ModuleSpec, T: int) -> float:
    w = torch.randn(spec.out_total, spec.in_dim, dtype=DT, device="cuda")
    sets = io_sets(spec, T, SETS)
    return _graphed([lambda x=x, y=y: torch.matmul(x, w.t(), out=y) for x, y in sets])


def cases(quick: bool):
    dec = [(t, n) for t in DECODE_T for n in NS if n <= t]
    pre = sorted({(t, min(n, t // SEGMENT)) for t in PREFILL_T for n in (1, 8, 128)})
    if quick:
        dec = [(1, 1), (64, 64), (256, 128)]
        pre = [(8192, 16)]
    return [("decode", t, n) for t, n in dec] + [("prefill", t, n) for t, n in pre]


def run(argv: list[str]) -> dict:
    if any(
        a == "--ab" or a.startswith("--ab=") for a in argv
    ):  # before/after of two src/loraplane/kernels/ trees: ab.py
        return runpy.run_path(str(Path(__file__).with_name("ab.py")))["run"](argv, globals())
    p = argparse.ArgumentParser(prog="bench/run.py kernels")
    p.add_argument("--quick", action="store_true", help="3 decode + 1 prefill case per shape and rank")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--sweep", action="store_true", help="only try launch-config variants on a few cases")
    p.add_argument("--plot", default=None, help="PNG path for time vs floor")
    args = p.parse_args(argv)
    t0 = time.time()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows, shapes = [], args.shapes.split(",")
    base = {}
    if args.sweep:
        sweep = run_sweep(bw, base)
        cols = ["shape", "rank", "phase", "T", "n", "variant", "us", "floor_us", "x_floor", "err"]
        return {"title": "launch-config sweep", "columns": cols, "rows": sweep, "meta": {}, "notes": []}
    for name in shapes:
        spec = SHAPES[name]
        for T in sorted({t for _, t, _ in cases(args.quick)}):
            base[(name, T)] = base_gemm_us(spec, T)
        for rname, ranks in RANKS.items():
            bank = make_bank(spec, ranks, RESIDENT)
            for phase, T, n in cases(args.quick):
                row = run_case(bank, phase, T, n, bw, base[(name, T)], not args.no_baselines)
                row.update(shape=name, rank=rname)
                rows.append(row)
                print(case_line(row), flush=True)
            del bank
            torch.cuda.empty_cache()
    rows += idle_resident_rows(bw, base, shapes)
    summary = summarize(rows)
    if args.plot:
        plot(rows, args.plot)
    return {
        "title": "multi-LoRA shrink+expand, H200 bf16 (us, CUDA-graph replay, median, L2 flushed)",
        "columns": COLUMNS,
        "rows": rows,
        "meta": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "copy_bandwidth_TBps": round(bw / 1e12, 3),
            "resident_adapters": RESIDENT,
            "wall_s": round(time.time() - t0, 1),
        },
        "notes": summary,
    }


def idle_resident_rows(bw: float, base: dict, shapes) -> list[dict]:
    """Same active set, pools of 8 versus 128 resident adapters: time must not follow idle residents."""
    rows = []
    for name in [s for s in ("q_proj", "gate_up") if s in shapes]:
        for resident in (8, RESIDENT):
            bank = make_bank(SHAPES[name], (16,), resident)
            row = run_case(
                bank, "decode", 64, 8, bw, base.get((name, 64)) or base_gemm_us(SHAPES[name], 64), False
            )
            row.update(shape=name, rank="r16", phase=f"decode/res{resident}")
            rows.append(row)
            print(case_line(row), flush=True)
    return rows


def run_sweep(bw: float, base: dict) -> list[dict]:
    """Launch-config variants on representative cases; prints one line each."""

    picks = [
        ("q_proj", "r16", "decode", 1, 1), ("gate_up", "r64", "decode", 1, 1), ("q_proj", "r16", "decode", 64, 64),
        ("gate_up", "r16", "decode", 64, 64), ("qkv", "mix8/64", "decode", 16, 8),
        ("gate_up", "r16", "prefill", 8192, 16), ("qkv", "r64", "prefill", 8192, 16),
    ]  # fmt: skip
    out = []
    for name, rname, phase, T, n in picks:
        bank = make_bank(SHAPES[name], RANKS[rname], RESIDENT)
        meta = LoRABatchMeta(
            T, "cuda", tile_m=16 if phase == "decode" else 64, capture=phase == "decode",
            max_rank=max(bank.pool.host_ranks()),
        )  # fmt: skip
        meta.build([(bank.slots[a], c) for a, c in case_requests(phase, T, n)], bank.pool.host_ranks())
        d = pick_config(meta, bank.spec.in_dim, bank.spec.out_dims, DT)
        variants = {"default": d}
        for f, vals in {
            "block_n": (64, 256), "n_chunk": (d.n_chunk // 2, d.n_chunk * 2), "block_r": (16, 32, 128),
            "shrink_block_r": (32, 64), "split_k": (d.split_k // 2, d.split_k * 2), "fused": (True, False),
            "num_warps": (8,), "num_stages": (2, 4),
        }.items():  # fmt: skip
            for v in vals:
                try:
                    if getattr(d, f) != v:
                        variants[f"{f}={v}"] = dataclasses.replace(d, **{f: v})
                except ValueError:  # e.g. split_k 0 or n_chunk below block_n
                    continue
        for label, cfg in variants.items():
            try:
                if (
                    cfg.split_k < 1
                    or cfg.n_chunk < cfg.block_n
                    or any(w % cfg.n_chunk for w in bank.spec.out_dims)
                ):
                    continue
                row = run_case(bank, phase, T, n, bw, base.get((name, T), 1.0), False, cfg)
            except Exception as exc:  # a variant that fails to compile is reported, not fatal
                print(f"sweep {name} {rname} {phase} T={T} n={n} {label}: {type(exc).__name__} {exc}"[:300])
                continue
            row.update(shape=name, rank=rname, variant=label, config=dataclasses.asdict(cfg))
            out.append(row)
            print(f"sweep {name:8s} {rname:8s} {phase:7s} T={T:5d} n={n:3d} {label:22s} {row['us']:8.1f}us "
                  f"x{row['x_floor']:.2f} err {row['err']:.1e}", flush=True)  # fmt: skip
        del bank
        torch.cuda.empty_cache()
    return out
