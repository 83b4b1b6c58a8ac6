"""One rank of the TP-vs-whole agreement check (run by test_tensor_parallel_agreement.py, one process per rank).

Every rank builds the same whole model with random weights (same seed), then its shard of it; rank 0 compares
the shard group's logits with the whole model's on a batch of three prefill spans and writes the errors.

    python tests/engine/tp_agreement.py RANK SIZE INIT_METHOD SHAPE_JSON DEVICE OUT_JSON [WATCHDOG_S]

A rank still running after WATCHDOG_S seconds prints its stacks and exits (a collective that never pairs up
fails the test with the place it hung, instead of hanging it).
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time
from datetime import timedelta

import torch


def say(rank: int, start: float, what: str) -> None:
    print(f"[tp_agreement rank {rank} +{time.monotonic() - start:.1f}s] {what}", file=sys.stderr, flush=True)


def main(rank: int, size: int, init: str, shape: dict, device: str, out: str, watchdog_s: int = 240) -> None:
    start = time.monotonic()
    faulthandler.dump_traceback_later(watchdog_s, exit=True)
    from loraplane.engine.model.attention import AttentionMetadata, PrefillSpan
    from loraplane.engine.model.model_config import ModelConfig
    from loraplane.engine.model.weights import random_model
    from loraplane.engine.parallel.group import destroy_group, init_group
    from loraplane.engine.parallel.loader import shard_model

    torch.set_num_threads(1)
    tp = init_group(rank, size, init, torch.device(device), timedelta(seconds=watchdog_s))
    say(rank, start, f"group ready on {tp.device}")
    dtype = torch.bfloat16 if tp.device.type == "cuda" else torch.float32
    cfg = ModelConfig.from_dict(shape, max_model_len=256)
    full = random_model(cfg, tp.device, dtype, seed=0)
    shard = shard_model(full, tp)
    say(rank, start, "whole model and shard built")
    lens = (5, 40, 17)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=gen).to(tp.device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(tp.device)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    meta = AttentionMetadata(slot_mapping=torch.full((sum(lens),), -1, device=tp.device),
                             prefill=[PrefillSpan(s, n, n, -1) for s, n in zip(starts, lens, strict=True)])  # fmt: skip
    rows = torch.tensor([s + n - 1 for s, n in zip(starts, lens, strict=True)], device=tp.device)
    errors = {}
    with torch.inference_mode():
        for model in (shard, full):
            model.init_rope(256, tp.device)
            for layer in model.model.layers:  # nothing is stored (slots -1) or read from the cache
                layer.self_attn.k_cache = torch.zeros(1, 16, model.config.num_kv_heads, cfg.head_dim,
                                                      dtype=dtype, device=tp.device)  # fmt: skip
                layer.self_attn.v_cache = torch.zeros_like(layer.self_attn.k_cache)
        got = shard(ids, positions, meta, rows)  # every rank: the collectives pair up
        if rank == 0:
            want = full(ids, positions, meta, rows)
            diff = (got.double() - want.double()).abs()
            errors = {
                "max_abs": diff.max().item(),
                "max_want": want.double().abs().max().item(),
                "max_rel_norm": max(
                    ((got[i].double() - want[i].double()).norm() / want[i].double().norm()).item()
                    for i in range(len(lens))
                ),
                "greedy_equal": bool((got.argmax(-1) == want.argmax(-1)).all()),
                "dtype": str(dtype),
            }
    say(rank, start, f"compared: {errors}")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(errors, f)
    # Leave together: a rank that exits while its peer still computes tears the pair's sockets down under it.
    torch.distributed.barrier()
    left = destroy_group(timeout_s=20)  # no graphs here: it leaves at once
    say(rank, start, f"left the group: {left}")
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    r, n, init, shape, dev, out = sys.argv[1:7]
    main(int(r), int(n), init, json.loads(shape), dev, out, *map(int, sys.argv[7:8]))
