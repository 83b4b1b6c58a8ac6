"""Tensor-parallel decode step: a Llama-shaped model with random weights split over N processes.

Each rank builds its shard in memory (``random_sharded_model``) and a ModelRunner on it; every rank runs the
same decode batch (B sequences at context 512), so the collectives pair up with no broadcast. Per batch size:
the step's time (CUDA graph when it fits), the measured time of its collectives alone (2 all-reduces of
[B, H] per layer, one for the embedding, one all-gather of the logits), and the floor: per-GPU weight and
KV bytes over the measured copy bandwidth, plus that collective time. ``--adapters K`` adds K distinct
random rank-16 adapters on all seven modules, one per sequence round-robin.

    python bench/run.py tp --out DIR [--shape llama3-70b|llama3-8b|tiny] [--tp 2] [--adapters 32]
    python bench/run.py tp --out DIR --shape tiny --device cpu      (checks the script on CPU, gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loraplane.server.engine.config import EngineConfig
from loraplane.server.engine.lora_weights import TARGET_MODULES, AdapterWeights, module_shapes
from loraplane.server.engine.model_config import ModelConfig
from loraplane.server.engine.model_runner import ModelRunner
from loraplane.server.engine.parallel.group import init_group
from loraplane.server.engine.parallel.loader import random_sharded_model
from loraplane.server.engine.parallel.lora_sync import shard_adapter
from loraplane.server.engine.scheduler import ScheduledBatch, ScheduledChunk
from loraplane.server.engine.sequence import SamplingParams, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared shapes
from shapes import LLAMA3_8B, LLAMA3_70B, TINY_LLAMA  # noqa: E402

SHAPES = {"llama3-70b": LLAMA3_70B, "llama3-8b": LLAMA3_8B, "tiny": TINY_LLAMA}
CTX, BATCHES = 512, (1, 16, 64, 128)


def median_ms(fn, device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    if device.type == "cpu":  # CPU checks the script, not the speed
        iters, warmup = 2, 1
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def random_adapter(cfg: ModelConfig, rank: int, dtype: torch.dtype, seed: int) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    w = AdapterWeights(a={}, b={})
    for m in TARGET_MODULES:
        fan_in, fan_out = module_shapes(cfg)[m]
        w.a[m] = (torch.randn(cfg.num_layers, rank, fan_in, generator=gen) * fan_in**-0.5).to(dtype)
        w.b[m] = (torch.randn(cfg.num_layers, fan_out, rank, generator=gen) * 0.01).to(dtype)
        w.ranks[m] = rank
    return w


class _OwnShard:
    """In place of the serving path's AdapterMirror: no messages, just this rank's shard of each copy."""

    def __init__(self, cfg: ModelConfig, tp) -> None:
        self.cfg, self.tp = cfg, tp

    def copy(self, slot: int, weights: AdapterWeights) -> AdapterWeights:
        return shard_adapter(weights, self.cfg, self.tp)

    def evict(self, slot: int) -> None:
        pass


def decode_batch(runner: ModelRunner, B: int, keys: list[str]) -> ScheduledBatch:
    per = -(-(CTX + 1) // runner.block_size)
    chunks = []
    for i in range(B):
        seq = Sequence(
            [1] * CTX, SamplingParams(temperature=0.0), adapter=keys[i % len(keys)] if keys else None
        )
        seq.block_table = list(range(i * per, (i + 1) * per))
        seq.num_computed_tokens = CTX - 1
        chunks.append(ScheduledChunk(seq, CTX - 1, 1, True))
    return ScheduledBatch(chunks)


def rank_main(args) -> None:
    """One rank: build the shard and runner, time every batch size; rank 0 writes the rows."""
    device = torch.device(args.device)
    torch.set_num_threads(1 if device.type == "cpu" else torch.get_num_threads())
    tp = init_group(args.rank, args.tp, args.init_method, device)
    dtype = torch.bfloat16 if tp.device.type == "cuda" else torch.float32
    cfg = ModelConfig.from_dict(SHAPES[args.shape], max_model_len=CTX + 16)
    batches = (1, 4) if tp.device.type == "cpu" else BATCHES
    per = -(-(CTX + 1) // 16)
    config = EngineConfig(model=args.folder, device=tp.device.type, dtype=str(dtype).split(".")[1], block_size=16,
                          num_kv_blocks=max(batches) * per, max_num_seqs=max(batches), max_model_len=CTX + 16,
                          max_num_batched_tokens=max(batches) * 2, enable_lora=args.adapters > 0,
                          max_loras=max(args.adapters, 1), max_lora_rank=16, lora_host_bytes=1 << 50,
                          cuda_graph_batch_sizes=batches)  # fmt: skip
    model = random_sharded_model(cfg, tp, tp.device, dtype)
    runner = ModelRunner(config, model=model, model_config=cfg, tp=tp)
    if runner.lora is not None:  # every rank decides the same moves itself here; it only keeps its shard
        runner.lora.gpu.mirror = _OwnShard(cfg, tp)
    keys = []
    for i in range(args.adapters):
        runner.lora.register(
            f"a{i}", "v1", Path("/nonexistent"), f"a{i}", random_adapter(cfg, 16, dtype, seed=i)
        )
        keys.append(f"a{i}@v1")
    for layer in runner.model.model.layers:  # random KV, never zeros
        layer.self_attn.k_cache.normal_()
        layer.self_attn.v_cache.normal_()
    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in runner.model.named_parameters() if "embed" not in n
    )
    kv_token = 2 * cfg.num_layers * runner.model_config.num_kv_heads * cfg.head_dim * dtype.itemsize
    bw = None
    if tp.device.type == "cuda":
        src = torch.empty(1 << 30, dtype=torch.bfloat16, device=tp.device)
        dst = torch.empty_like(src)
        bw = 2 * src.numel() * 2 / median_ms(lambda: dst.copy_(src), tp.device) / 1e6  # GB/s read + written
    rows = []
    with torch.inference_mode():
        for B in batches:
            batch = decode_batch(runner, B, keys)
            step_ms = median_ms(lambda batch=batch: runner.forward_logits(batch), tp.device)
            h = torch.zeros(B, cfg.hidden_size, dtype=dtype, device=tp.device)
            logits = torch.zeros(B, -(-cfg.vocab_size // args.tp), dtype=torch.float32, device=tp.device)
            reduce_ms = median_ms(lambda h=h: dist.all_reduce(h), tp.device)
            gather_ms = median_ms(lambda lg=logits: tp.all_gather_last(lg), tp.device)
            comm_ms = (2 * cfg.num_layers + 1) * reduce_ms + gather_ms
            row = {"case": f"decode B={B} ctx={CTX}", "batch": B, "step_ms": step_ms, "comm_ms": comm_ms,
                   "all_reduce_us": reduce_ms * 1e3}  # fmt: skip
            if bw is not None:
                row["floor_ms"] = (weight_bytes + B * CTX * kv_token) / bw / 1e6 + comm_ms
                row["x_floor"] = step_ms / row["floor_ms"]
            rows.append(row)
    if tp.rank == 0:
        meta = {"shape": args.shape, "tensor_parallel_size": args.tp, "adapters": f"{args.adapters} x rank 16",
                "dtype": str(dtype), "device": torch.cuda.get_device_name(tp.device) if bw else "cpu (gloo)",
                "per-GPU weight GB": weight_bytes / 1e9, "copy GB/s": bw}  # fmt: skip
        Path(args.result).write_text(json.dumps({"rows": rows, "meta": meta}))
    dist.destroy_process_group()


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench/run.py tp")
    parser.add_argument("--shape", default="llama3-70b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=0)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder, result = Path(tmp, "model"), Path(tmp, "result.json")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(SHAPES[args.shape]))  # no weights: random, in memory
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        common = ["--shape", args.shape, "--tp", str(args.tp), "--adapters", str(args.adapters), "--device",
                  args.device, "--init-method", init, "--folder", str(folder), "--result", str(result)]  # fmt: skip
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *common], env=os.environ.copy())
                 for r in range(args.tp)]  # fmt: skip
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                p.kill()
        if any(codes):
            raise RuntimeError(f"bench ranks exited with {codes}")
        out = json.loads(result.read_text())
    return {
        "title": f"Tensor-parallel decode step: {args.shape}, TP={args.tp}, {args.adapters} adapters",
        "columns": ["case", "step_ms", "comm_ms", "all_reduce_us", "floor_ms", "x_floor"],
        "rows": out["rows"],
        "meta": out["meta"],
        "notes": [
            "step: ModelRunner.forward_logits on every rank (CUDA graph when the batch fits).",
            "comm: (2 per layer + 1) all-reduces of [B, H] and one all-gather of the logits, timed alone.",
            "floor: (per-GPU weights but the embedding + per-GPU KV of the batch) / copy bandwidth + comm.",
        ],
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for flag in ("--shape", "--device", "--init-method", "--folder", "--result"):
        p.add_argument(flag)
    for flag in ("--rank", "--tp", "--adapters"):
        p.add_argument(flag, type=int)
    rank_main(p.parse_args())
