"""Where a T = 2,048 prefill's LoRA time goes, op by op, against its bytes and the base GEMM beside it.

The decode benchmark's prefill row (8 sequences of 256 tokens, 8 distinct r16 all-module adapters) costs
about 1.16x the base prefill. Per op (qkv, o, gate_up, down) over 32 layers, each in one CUDA graph so
that the host is out of the picture:

- ``gemm``: the base projection alone (``torch.mm`` into y), and its FLOP rate;
- ``lora``: the LoRA shrink and expand alone, with the eager prefill's launch shapes (``pick_config`` on a
  ``tile_m=64`` metadata, as the engine's prefill metadata), and each kernel's time from the profiler;
- ``both``: the GEMM and then the LoRA ops, as a prefill layer ran them before delta-first; ``beside``: the
  same with the shrink on a side stream beside the GEMM;
- variant ``store``: ``delta_first``, as the engine's prefill runs them now: the LoRA ops write the delta
  into an empty y (the expand never reads y) and the GEMM adds itself on top (``y.addmm_``, beta = 1);
  ``gemm_acc``: that GEMM alone; ``lora``: the storing LoRA ops alone;
- ``bytes_floor_us``: what the LoRA kernels must move (x read by the shrink, y read and written by the
  expand, A and B of the step's adapters) at the copy bandwidth measured in the same run.

    python bench/lora_decode/prefill_probe.py --out DIR        # src/ importable: scripts/device_env.sh
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe import MAX_RANK, OPS, SHAPES, L, Step, build_pools, copy_gbs, graph_of, ranks_of, replay_ms  # noqa: E402

from loraplane.kernels import LoRABatchMeta  # noqa: E402
from loraplane.kernels.overlap import beside_stream  # noqa: E402

T, SEQS, RANK = 2048, 8, 16


def variants() -> list[tuple[str, object]]:
    """Launch-config overrides of the expand and shrink, one field at a time."""
    rep = dataclasses.replace
    return [
        ("default", None),
        ("store", lambda c: rep(c, store=True)),
        ("split_k=1", lambda c: rep(c, split_k=1)),
        ("split_k=4", lambda c: rep(c, split_k=4)),
        ("block_n=128", lambda c: rep(c, block_n=128, n_chunk=max(128, c.n_chunk))),
        ("n_chunk=512", lambda c: rep(c, n_chunk=max(512, c.block_n))),
        ("warps=8", lambda c: rep(c, num_warps=8)),
        ("stages=2", lambda c: rep(c, num_stages=2)),
    ]


class PrefillOp:
    """One op over 32 layers: the base GEMM, its LoRA ops (probe.Step's launches), or both (x, y and W
    shared by the layers)."""

    def __init__(self, op, pools, meta, dev, over=None):
        self.op, self.mods = op, OPS[op]
        self.step = Step(pools, meta, dev, ops=(op,), cfgs={op: over} if over else None)
        self.k, self.n = SHAPES[self.mods[0]][0], sum(SHAPES[m][1] for m in self.mods)
        self.x = self.step.x[op] = torch.randn(T, self.k, device=dev, dtype=torch.bfloat16) * 0.1  # [T, K]
        self.y = self.step.y[op] = torch.empty(T, self.n, device=dev, dtype=torch.bfloat16)  # [T, N]
        self.w = torch.randn(self.n, self.k, device=dev, dtype=torch.bfloat16) * 0.02  # [N, K]
        self.cfg = self.step.cfg(op)

    def gemm(self):
        for _ in range(L):
            torch.mm(self.x, self.w.t(), out=self.y)

    def lora(self):
        for layer in range(L):
            self.step.apply(self.op, layer)

    def both(self):
        for layer in range(L):
            torch.mm(self.x, self.w.t(), out=self.y)
            self.step.apply(self.op, layer)

    def gemm_acc(self):
        for _ in range(L):
            self.y.addmm_(self.x, self.w.t())

    def delta_first(self):
        for layer in range(L):
            self.step.apply(self.op, layer)
            self.y.addmm_(self.x, self.w.t())

    def beside(self):
        side = beside_stream(self.x.device)
        for layer in range(L):
            self.step.apply(self.op, layer, lambda: torch.mm(self.x, self.w.t(), out=self.y), side)

    def lora_bytes(self) -> int:
        """Bytes the LoRA kernels of one layer must move: x once, y twice (once when storing), A and B of
        SEQS r16 adapters."""
        y_passes = 1 if self.cfg.store else 2
        return 2 * (T * self.k + y_passes * T * self.n + SEQS * RANK * (self.k * len(self.mods) + self.n))


def kernel_us(fn) -> dict:
    """Median duration of each kernel name in one call of ``fn`` (captured), µs."""
    from torch.profiler import ProfilerActivity, profile

    g = graph_of(fn)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        g.replay()
        torch.cuda.synchronize()
    by: dict[str, list[float]] = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by.setdefault(e.name[:48], []).append(e.time_range.elapsed_us())
    return {k: {"median_us": round(statistics.median(v), 2), "n": len(v)} for k, v in by.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true", help="launch-config variants of each op's LoRA kernels")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    pools, slots = build_pools(dev)
    ranks = ranks_of(pools)
    meta = LoRABatchMeta(T, dev, tile_m=64, max_rank=MAX_RANK)
    meta.build([(s, T // SEQS) for s in slots["d"][:SEQS]], ranks)
    bw = copy_gbs(dev)
    res: dict = {"device": torch.cuda.get_device_name(), "copy_gbs": bw, "rows": []}
    for op in OPS:
        for name, over in variants() if args.sweep else variants()[:2]:
            try:
                po = PrefillOp(op, pools, meta, dev, over)
                row = {"op": op, "variant": name, "cfg": repr(po.cfg)}
                parts = {
                    "default": ("gemm", "lora", "both", "beside"),
                    "store": ("gemm_acc", "lora", "delta_first"),
                }
                for part in parts.get(name, ("lora",)):
                    row[f"{part}_us"] = round(replay_ms(graph_of(getattr(po, part)), 10) * 1e3 / L, 1)
            except Exception as e:  # noqa: BLE001 - a variant may not compile (shared memory)
                row = {"op": op, "variant": name, "error": repr(e)[:200]}
                print(json.dumps(row), flush=True)
                continue
            row["bytes_floor_us"] = round(po.lora_bytes() / (bw * 1e3), 1)
            if name == "default":
                row["gemm_tflops"] = round(2 * T * po.k * po.n / (row["gemm_us"] * 1e6), 1)
                row["kernels"] = kernel_us(po.lora)
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            (out / "prefill_probe.json").write_text(json.dumps(res, indent=1))
            del po
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
