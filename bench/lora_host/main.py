"""Host time of a decode step's LoRA preparation: ``AdapterTiers.prepare_step`` (residency checks, the
unloading sweep, the batch metadata built and queued for upload), which runs on the engine thread before
every step's launches while the device waits.

The cost depends on the step's rows and adapters and on how many versions are registered, not on the
model's width, so a tiny model on the CPU measures it (the device copy is queued, never waited on).

    python bench/run.py lora_host --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from loraplane.engine.lora.layers import build_pools
from loraplane.engine.lora.manager import AdapterTiers
from loraplane.engine.lora.weights import TARGET_MODULES
from loraplane.engine.model.model_config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: shared shapes and helpers
from shapes import TINY_LLAMA  # noqa: E402
from synth import adapter_weights  # noqa: E402

B = 64  # decode rows, as bench/lora_decode


def tiers(registered: int) -> AdapterTiers:
    """Pools for 64 resident r16 all-module adapters, ``registered`` versions in all (host tier)."""
    cfg = ModelConfig.from_dict(TINY_LLAMA, max_model_len=512)
    pools = build_pools(cfg, B * 16, 64, torch.float32, torch.device("cpu"))
    lora = AdapterTiers(cfg, pools, max_rank=64, host_bytes=1 << 50, max_num_batched_tokens=4096,
                        max_num_seqs=B, graph_batch_size=B, host_arena=False)  # fmt: skip
    w = adapter_weights(cfg, 16, TARGET_MODULES, torch.float32, seed=1)
    for i in range(registered):
        lora.register(f"d{i}", "v1", Path("/nonexistent"), f"d{i}", w)
    lora.ensure_resident([f"d{i}@v1" for i in range(B)])
    return lora


def median_us(fn, iters: int) -> float:
    for _ in range(max(3, iters // 10)):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench lora_host")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (checks the script)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    iters = 20 if args.quick else 300
    steps = {
        "64 distinct": [(f"d{i}@v1", 1) for i in range(B)],
        "1 adapter": [("d0@v1", 1)] * B,
        "mixed: 32 base-only, 32 distinct": [(None if i % 2 == 0 else f"d{i // 2}@v1", 1) for i in range(B)],
        "base-only": [(None, 1)] * B,
    }
    rows = []
    for registered in (B, 2000):
        lora = tiers(registered)
        for case, chunks in steps.items():
            for kind in ("graph", "decode"):
                us = median_us(lambda t=lora, c=chunks, k=kind: t.prepare_step(c, k), iters)
                rows.append({"case": case, "kind": kind, "registered": registered, "prepare_step_us": us})
                print(rows[-1], flush=True)
    return {
        "title": "Host time of a B=64 decode step's LoRA preparation (AdapterTiers.prepare_step)",
        "columns": ["case", "kind", "registered", "prepare_step_us"],
        "rows": rows,
        "meta": {"torch": torch.__version__, "python": sys.version.split()[0], "iterations": iters},
        "notes": [
            "kind graph: metadata for the captured decode graphs; decode: the eager decode path.",
            "registered: adapter versions known to the engine (64 of them resident on the device).",
            "median of perf_counter around one prepare_step, one torch thread, tiny model on the CPU.",
        ],
    }
