"""The engine thread's own work per adapter load, without a GPU: ``GpuTier.start_copy`` (allocate the slot's
rows in every module's pool, write the device tables, place the factors) on PyTorch's ``meta`` device, where
every tensor op is dispatched as on CUDA but moves no data. Reports the tensor ops per load that launch work
(each is a kernel launch or a copy on CUDA: a few microseconds of the engine thread apiece) and the host time
per load, on the Llama-3-8B shape with ranks {8, 16, 32, 64}, through a pool that evicts (scattered rows).

    PYTHONPATH=src python bench/churn/load_cost.py [--loads 200] [--pool-gib 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import LLAMA3_8B  # noqa: E402

from loraplane.engine.lora.layers import build_pools, pool_row_bytes  # noqa: E402
from loraplane.engine.lora.tiers import GpuTier  # noqa: E402
from loraplane.engine.lora.weights import AdapterWeights, module_shapes  # noqa: E402
from loraplane.engine.model.model_config import ModelConfig  # noqa: E402

RANKS = (8, 16, 32, 64)
NO_WORK = set("slice select view transpose detach lift_fresh as_strided _local_scalar_dense alias".split())


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ not in NO_WORK
        return func(*args, **(kwargs or {}))


def weights(cfg: ModelConfig, rank: int) -> AdapterWeights:
    out = AdapterWeights(a={}, b={})
    for m, (fan_in, fan_out) in module_shapes(cfg).items():
        out.a[m] = torch.empty(cfg.num_layers, rank, fan_in, dtype=torch.bfloat16, device="meta")
        out.b[m] = torch.empty(cfg.num_layers, fan_out, rank, dtype=torch.bfloat16, device="meta")
        out.ranks[m] = rank
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench churn load_cost")
    parser.add_argument("--loads", type=int, default=200)
    parser.add_argument("--pool-gib", type=float, default=8.0)
    args = parser.parse_args(argv)
    cfg = ModelConfig.from_dict(LLAMA3_8B, max_model_len=2048)
    meta = torch.device("meta")
    rows = int(args.pool_gib * (1 << 30)) // sum(pool_row_bytes(cfg, torch.bfloat16).values())
    tier = GpuTier(build_pools(cfg, rows, 64, torch.bfloat16, meta), meta)
    ops, seconds = [], []
    for n in range(args.loads):
        w = weights(cfg, RANKS[(n * 7) % len(RANKS)])  # ranks mixed: evictions scatter the free rows
        assert tier.make_room(w, lambda key: True)
        if n < args.loads // 4:  # the pool's first fill: rows still consecutive
            tier.start_copy(f"a{n}", w)
        elif n % 2:  # counted (the counting itself costs host time, so these are not timed)
            with Ops() as counter:
                tier.start_copy(f"a{n}", w)
            ops.append(counter.count)
        else:
            start = time.perf_counter()
            tier.start_copy(f"a{n}", w)
            seconds.append(time.perf_counter() - start)
    return {"pool_rows": rows, "loads": args.loads, "ops_per_load_p50": statistics.median(ops),
            "ops_per_load_max": max(ops), "host_ms_per_load_p50": statistics.median(seconds) * 1e3,
            "host_ms_per_load_max": max(seconds) * 1e3, "torch": torch.__version__}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
