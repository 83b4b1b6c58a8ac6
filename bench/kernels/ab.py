"""Before/after: a baseline copy of src/loraplane/kernels/ against this tree's, the same cases in one process.

``python bench/run.py kernels --name kernels-ab --ab BASELINE [--warm-only] [--shapes ...]``. BASELINE is
a folder holding a whole src/loraplane/kernels/ package (or a git ref, copied with ``git show``). Every case shares
one pool, metadata and input sets between the two; each side is timed ROUNDS times, alternating
(CUDA-graph replay, median of ``do_bench``, L2 flushed, 4 rotating input sets), and reports the median
of its rounds and the spread of its rounds (noise). Both outputs are compared element for element.
Ragged rows (new kernels only) set a width or slice start that the baseline refused next to an aligned
neighbour. ``--warm-only`` runs each case once (compiles; fills Triton's disk cache) and times nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

from loraplane.kernels import LoRABatchMeta, ModuleSpec, lora_apply

ROUNDS = 3
CASES = [("decode", 1, 1), ("decode", 16, 8), ("decode", 64, 64), ("decode", 256, 128)]
CASES += [("prefill", 2048, 4), ("prefill", 8192, 16)]
# (name, spec, aligned neighbour): ragged widths and starts from tensor-parallel shards.
RAGGED = [
    ("w3784", ModuleSpec(4096, (3784,)), ModuleSpec(4096, (3840,))),
    ("w2049@3", ModuleSpec(2049, (2049,), slice_starts=(3,), y_width=2056), ModuleSpec(2048, (2048,))),
    ("qkv/2004", ModuleSpec(4096, (2004, 501, 501)), ModuleSpec(4096, (2048, 512, 512))),
    ("in3784", ModuleSpec(3784, (4096,)), ModuleSpec(3840, (4096,))),
]
RAGGED_CASES = [("decode", 64, 64), ("prefill", 8192, 16)]
COLUMNS = [
    "shape",
    "rank",
    "phase",
    "T",
    "n",
    "before_us",
    "after_us",
    "after/before",
    "noise",
    "floor_us",
    "same_out",
]


def load_baseline(where: str):
    """Import a src/loraplane/kernels/ package from a folder (or a git ref) as ``kernels_baseline``.

    The package's own absolute imports (``loraplane.kernels.x``) are rewritten to ``kernels_baseline.x`` in a
    private copy, so the baseline runs wholly on its own modules and never on this tree's."""
    folder = Path(tempfile.mkdtemp(prefix="kernels-baseline-"))
    source = Path(where)
    if (source / "triton_ops.py").is_file():
        files = {f.name: f.read_bytes() for f in source.glob("*.py")}
    else:
        names = subprocess.run(
            ["git", "ls-tree", "--name-only", where, "src/loraplane/kernels/"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        files = {
            Path(f).name: subprocess.run(
                ["git", "show", f"{where}:{f}"], check=True, capture_output=True
            ).stdout
            for f in names
            if f.endswith(".py")
        }
    if "__init__.py" not in files:
        raise SystemExit(f"--ab {where}: no src/loraplane/kernels/ package there")
    for name, blob in files.items():
        (folder / name).write_bytes(blob.replace(b"loraplane.kernels", b"kernels_baseline"))
    spec = importlib.util.spec_from_file_location(
        "kernels_baseline", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kernels_baseline"] = mod
    spec.loader.exec_module(mod)
    return mod


def mirror_pool(old, pool):
    """The baseline's own LoRAPool holding the same adapters, pages and weights as ``pool`` (one layer,
    module "m"), so both sides read identical bytes from identical page rows."""
    spec = pool.modules["m"]
    old_spec = old.ModuleSpec(
        spec.in_dim, spec.out_dims, slice_starts=spec.slice_starts, y_width=spec.y_width
    )
    twin = old.LoRAPool(
        {"m": old_spec},
        1,
        pool.num_pages * pool.page_bytes,
        page_rank=pool.page_rank,
        max_rank=pool.max_rank,
        max_adapters=pool.max_adapters,
        dtype=pool.dtype,
        device=pool.device,
    )
    # Allocation order decides page placement: replay it (a fresh pool hands out pages in ascending order).
    held = [slot for slot, rank in enumerate(pool.host_ranks()) if rank]
    for slot in sorted(held, key=lambda s: pool.pages_of(s)[0]):
        got = twin.allocate(pool.rank_of(slot), pool.scale_of(slot), slot)
        if not torch.equal(twin.rows_of(got).cpu(), pool.rows_of(slot).cpu()):
            raise AssertionError(f"baseline pool placed slot {slot} on other page rows")
    twin.a[(0, "m")].copy_(pool.a[(0, "m")])
    twin.bt[(0, "m")].copy_(pool.bt[(0, "m")])
    return twin


def _old_fn(old, twin, reqs, T: int, capture: bool, x, y):
    """The baseline's lora_apply on its own pool and its own metadata for the same requests."""
    meta = _build_meta(old.LoRABatchMeta, twin, reqs, T, capture)
    return lambda: old.lora_apply(y, x, twin, 0, "m", meta)


def _new_fn(bank, meta, x, y):
    return lambda: lora_apply(y, x, bank.pool, 0, "m", meta)


def _build_meta(meta_class, pool, reqs, T: int, capture: bool):
    """``capture``: decode metadata for a captured graph (16-token tiles), else prefill's (64)."""
    meta = meta_class(
        T, pool.device, tile_m=16 if capture else 64, capture=capture, max_rank=max(pool.host_ranks())
    )
    return meta.build(reqs, pool.host_ranks())


def _meta(bank, phase, T, n, main):
    reqs = [(bank.slots[a], c) for a, c in main["case_requests"](phase, T, n)]
    return _build_meta(LoRABatchMeta, bank.pool, reqs, T, phase == "decode"), reqs


def _timed(fns_by_side: dict, graphed, warm_only: bool) -> dict:
    if warm_only:
        for fns in fns_by_side.values():
            for fn in fns:
                fn()
        torch.cuda.synchronize()
        return {side: [0.0] for side in fns_by_side}
    times = {side: [] for side in fns_by_side}
    for _ in range(ROUNDS):
        for side, fns in fns_by_side.items():
            times[side].append(graphed(fns))
    return times


def _row(times, side):
    med = statistics.median(times[side])
    spread = (max(times[side]) - min(times[side])) / med if med else 0.0
    return med, spread


def run(argv: list[str], main: dict) -> dict:
    p = argparse.ArgumentParser(prog="bench/run.py kernels --ab")
    p.add_argument("--ab", required=True, help="baseline src/loraplane/kernels/ folder or git ref")
    p.add_argument("--warm-only", action="store_true")
    p.add_argument("--shapes", default=",".join(main["SHAPES"]))
    p.add_argument("--no-ragged", action="store_true")
    args = p.parse_args(argv)
    t0 = time.time()
    old = load_baseline(args.ab)
    torch.manual_seed(0)
    bw = main["copy_bandwidth"]() if not args.warm_only else 4.25e12
    rows = []
    for name in [s for s in args.shapes.split(",") if s]:
        spec = main["SHAPES"][name]
        for rname, ranks in main["RANKS"].items():
            bank = main["make_bank"](spec, ranks, main["RESIDENT"])
            twin = mirror_pool(old, bank.pool)
            for phase, T, n in CASES:
                row = ab_case(old, twin, bank, (phase, T, n), main, bw, args.warm_only)
                row.update(shape=name, rank=rname)
                rows.append(row)
                print(_line(row), flush=True)
            del bank, twin
            torch.cuda.empty_cache()
    if not args.no_ragged:
        rows += ragged_rows(main, bw, args.warm_only)
    return {
        "title": "kernels before/after (us, bf16, CUDA-graph replay, median of rounds, L2 flushed)",
        "columns": COLUMNS,
        "rows": rows,
        "meta": {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "baseline": args.ab,
            "rounds": ROUNDS,
            "copy_bandwidth_TBps": round(bw / 1e12, 3),
            "wall_s": round(time.time() - t0, 1),
        },
        "notes": summarize(rows),
    }


def ab_case(old, twin, bank, case, main: dict, bw: float, warm_only: bool) -> dict:
    """One case: the baseline on ``twin`` (its mirror of the bank's pool) and this tree's kernels on the
    bank's pool, with the same requests and inputs."""
    phase, T, n = case
    meta, reqs = _meta(bank, phase, T, n, main)
    capture = phase == "decode"
    sets = main["io_sets"](bank.spec, T, main["SETS"])
    x, y = sets[0]
    before, after = y.clone(), y.clone()
    _old_fn(old, twin, reqs, T, capture, x, before)()
    _new_fn(bank, meta, x, after)()
    times = _timed(
        {
            "before": [_old_fn(old, twin, reqs, T, capture, x, y) for x, y in sets],
            "after": [_new_fn(bank, meta, x, y) for x, y in sets],
        },
        main["_graphed"],
        warm_only,
    )
    (b, nb), (a, na) = _row(times, "before"), _row(times, "after")
    floor = main["floor_bytes"](bank, main["case_requests"](phase, T, n), T) / bw * 1e6
    return dict(
        phase=phase, T=T, n=n, before_us=b, after_us=a, **{"after/before": a / b if b else None},
        noise=max(nb, na), floor_us=floor, same_out=bool(torch.equal(before, after)), times=times,
        out_diff=((after.float() - before.float()).norm() / (before.float() - y.float()).norm()).item(),
    )  # fmt: skip


def ragged_rows(main: dict, bw: float, warm_only: bool) -> list[dict]:
    """New kernels only: a ragged module against its aligned neighbour (the baseline refused the first)."""
    rows = []
    for name, spec, near in RAGGED:
        banks = {"after": main["make_bank"](spec, (16,), main["RESIDENT"])}
        banks["aligned"] = main["make_bank"](near, (16,), main["RESIDENT"])
        for phase, T, n in RAGGED_CASES:
            fns, floors = {}, {}
            for side, bank in banks.items():
                meta, _ = _meta(bank, phase, T, n, main)
                sets = [
                    (torch.randn(T, bank.spec.in_dim, dtype=main["DT"], device=bank.pool.device),
                     torch.randn(T, bank.spec.y_width, dtype=main["DT"], device=bank.pool.device))
                    for _ in range(main["SETS"])
                ]  # fmt: skip
                fns[side] = [_new_fn(bank, meta, x, y) for x, y in sets]
                floors[side] = main["floor_bytes"](bank, main["case_requests"](phase, T, n), T) / bw * 1e6
            times = _timed(fns, main["_graphed"], warm_only)
            (a, na), (al, nal) = _row(times, "after"), _row(times, "aligned")
            row = dict(
                shape=f"{name} vs {near.in_dim}->{near.out_dims}", rank="r16", phase=phase, T=T, n=n, before_us=None,
                after_us=a, aligned_us=al, **{"after/before": None}, noise=max(na, nal),
                floor_us=floors["after"], aligned_floor_us=floors["aligned"], same_out=None, times=times,
            )  # fmt: skip
            rows.append(row)
            print(_line(row), flush=True)
        del banks
        torch.cuda.empty_cache()
    return rows


def _line(r: dict) -> str:
    if r["before_us"] is None:
        return (
            f"ragged {r['shape']:32s} {r['phase']:7s} T={r['T']:5d} n={r['n']:3d} {r['after_us']:8.1f}us "
            f"(floor {r['floor_us']:.1f}) vs aligned {r['aligned_us']:8.1f}us (floor {r['aligned_floor_us']:.1f})"
        )
    ratio = f"{r['after/before']:.3f}" if r["after/before"] else "-"
    return (
        f"ab {r['shape']:8s} {r['rank']:8s} {r['phase']:7s} T={r['T']:5d} n={r['n']:3d} "
        f"before {r['before_us']:8.1f} after {r['after_us']:8.1f} x{ratio} noise {r['noise']:.3f} same={r['same_out']}"
    )


def summarize(rows: list[dict]) -> list[str]:
    ab = [r for r in rows if r["before_us"]]
    if not ab:
        return []
    ratios = [r["after/before"] for r in ab]
    within = sum(0.98 <= x <= 1.02 for x in ratios)
    worst = max(ab, key=lambda r: r["after/before"])
    notes = [
        f"after/before within 2%: {within}/{len(ab)}; median {statistics.median(ratios):.3f}, "
        f"min {min(ratios):.3f}, max {max(ratios):.3f} ({worst['shape']} {worst['rank']} {worst['phase']} "
        f"T={worst['T']} n={worst['n']})",
        f"median noise (spread of a side's rounds / its median): {statistics.median(r['noise'] for r in ab):.3f}",
        f"outputs bit-identical before/after: {sum(bool(r['same_out']) for r in ab)}/{len(ab)} "
        f"(largest |after - before| / |delta|: {max(r['out_diff'] for r in ab):.1e})",
    ]
    for r in rows:
        if r["before_us"] is None:
            notes.append(
                f"ragged {r['shape']} {r['phase']} T={r['T']} n={r['n']}: {r['after_us']:.1f} us vs aligned "
                f"{r['aligned_us']:.1f} us (x{r['after_us'] / r['aligned_us']:.2f}; floors {r['floor_us']:.1f} / "
                f"{r['aligned_floor_us']:.1f})"
            )
    return notes
