"""One LoRA op of one layer, launched eagerly a few times: a target for Nsight Compute.

    ncu --clock-control none -k regex:'^_(shrink|expand)' --launch-skip 2 --launch-count 2 \
        python3 bench/lora_decode/one_op.py --op gate_up --case d64 [--decode K,N,WARPS,DOT]

The pools, cases and launch configs are probe.py's (the engine's layout on the Llama-3-8B shape).
"""

from __future__ import annotations

import argparse

import torch
from probe import MAX_RANK, B, Step, build_pools, cases, decode_cfg, ranks_of

from loraplane.kernels import LoRABatchMeta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="gate_up")
    ap.add_argument("--case", default="d64")
    ap.add_argument("--decode", default="", help="K,N,WARPS,DOT: the decode kernels with these blocks")
    ap.add_argument("--times", type=int, default=3)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    pools, slots = build_pools(dev)
    meta = LoRABatchMeta(B, dev, tile_m=16, capture=True, max_rank=MAX_RANK)
    meta.build(cases(slots)[args.case], ranks_of(pools))
    cfgs = {}
    if args.decode:
        k, n, w, dot = (int(v) for v in args.decode.split(","))
        cfgs[args.op] = decode_cfg(k, n, bool(dot), w)
    step = Step(pools, meta, dev, ops=(args.op,), cfgs=cfgs)
    print(args.op, args.case, step.cfg(args.op), flush=True)
    for _ in range(args.times):
        step.apply(args.op, 0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
