"""Tensor-parallel decode step: a Llama-shaped model with random weights split over N processes.

Each rank builds its shard in memory (``random_sharded_model``) and a ModelRunner on it; every rank runs the
same decode batch (B sequences at context 512), so the collectives pair up with no broadcast. Per batch size:
the step's time (CUDA graph when it fits), the measured time of its collectives alone (2 all-reduces of
[B, H] per layer, one for the embedding, one all-gather of the logits), and the floor: per-GPU weight and
KV bytes over the measured copy bandwidth, plus that collective time. ``--adapters K`` registers K distinct
random rank-16 adapters on all seven modules and times each batch twice: base-only rows (the graphs without
LoRA launches) and rows with one adapter per sequence, round-robin. ``--with-tp1`` also times the same shape
on one GPU without any process group (the single-GPU engine), for the TP=N / TP=1 ratio.

Every rank prints its progress (phase, seconds since start) and, if it is still running after
``--watchdog-s``, dumps its stacks and exits; the launcher stops the other ranks as soon as one fails.

    python bench/run.py tp --out DIR [--shape llama3-70b|llama3-8b|tiny] [--tp 2] [--adapters 32] [--with-tp1]
    python bench/run.py tp --out DIR --shape tiny --device cpu      (checks the script on CPU, gloo)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk
from loraplane.engine.core.sequence import SamplingParams, Sequence
from loraplane.engine.lora.weights import TARGET_MODULES, AdapterWeights, module_shapes
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.model.runner import ModelRunner
from loraplane.engine.model.weights import random_model
from loraplane.engine.parallel.group import destroy_group, init_group, release_graphs
from loraplane.engine.parallel.loader import random_sharded_model
from loraplane.engine.parallel.lora_sync import shard_adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared shapes
from shapes import LLAMA3_8B, LLAMA3_70B, TINY_LLAMA  # noqa: E402

SHAPES = {"llama3-70b": LLAMA3_70B, "llama3-8b": LLAMA3_8B, "tiny": TINY_LLAMA}
CTX, BATCHES = 512, (1, 16, 64, 128)
_T0 = time.monotonic()


def say(rank: int, what: str) -> None:
    print(f"[tp rank {rank} +{time.monotonic() - _T0:6.1f}s] {what}", file=sys.stderr, flush=True)


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


def random_adapter(cfg: ModelConfig, rank: int, dtype: torch.dtype, seed: int,
                   device: torch.device) -> AdapterWeights:  # fmt: skip
    """A whole adapter drawn on ``device`` (the same on every rank: same seed, same device kind)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = AdapterWeights(a={}, b={})
    for m in TARGET_MODULES:
        fan_in, fan_out = module_shapes(cfg)[m]
        w.a[m] = torch.randn(cfg.num_layers, rank, fan_in, generator=gen, device=device, dtype=dtype)
        w.a[m] *= fan_in**-0.5  # [L, r, in]
        w.b[m] = torch.randn(cfg.num_layers, fan_out, rank, generator=gen, device=device, dtype=dtype)
        w.b[m] *= 0.01  # [L, out, r]
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


def adapter_bytes(cfg: ModelConfig, tp_size: int, rank: int = 16, itemsize: int = 2) -> int:
    """Bytes one GPU reads per distinct rank-``rank`` adapter of a step: its shard of all seven modules
    (column-parallel: A whole, B split; row-parallel: A split, B whole; see lora_sync.shard_adapter)."""
    total = 0
    for m in TARGET_MODULES:
        fan_in, fan_out = module_shapes(cfg)[m]
        a, b = (fan_in // tp_size, fan_out) if m in ("o_proj", "down_proj") else (fan_in, fan_out // tp_size)
        total += cfg.num_layers * rank * (a + b) * itemsize
    return total


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


def comm_time(tp, B: int, cfg: ModelConfig, dtype: torch.dtype) -> tuple[float, float]:
    """(ms of the step's messages, ms of one all-reduce): the 2 L + 1 all-reduces of [B, H] and the
    all-gather of the [B, V/N] logits, captured in CUDA graphs as in the step and timed by replay (on CPU:
    eager, one all-reduce times the count)."""
    h = torch.randn(B, cfg.hidden_size, dtype=dtype, device=tp.device)  # [B, H]
    logits = torch.randn(B, -(-cfg.vocab_size // tp.size), dtype=dtype, device=tp.device)  # bf16, as the head
    n = 2 * cfg.num_layers + 1
    reduces = [lambda: dist.all_reduce(h)] * n  # the values overflow; NCCL's speed does not depend on them
    gather = [lambda: tp.all_gather_last(logits)]
    if tp.device.type != "cuda":
        reduce_ms = median_ms(reduces[0], tp.device)
        return n * reduce_ms + median_ms(gather[0], tp.device), reduce_ms
    times = []
    for calls in (reduces, gather):
        for call in calls:  # warm-up outside the capture
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        times.append(median_ms(graph.replay, tp.device, iters=10))
    return sum(times), times[0] / n


def graph_vs_eager(runner: ModelRunner, batch: ScheduledBatch) -> float:
    """Relative norm error of the graph replay's logits against the eager forward of the same step (every
    rank runs both, so the eager collectives pair up too): the captured all-reduces compute the sum."""
    graphed = runner.forward_logits(batch).double()
    graphs, base_graphs = runner.graphs, runner.base_graphs
    runner.graphs = runner.base_graphs = None
    try:
        eager = runner.forward_logits(batch).double()
    finally:
        runner.graphs, runner.base_graphs = graphs, base_graphs
    return ((graphed - eager).norm() / eager.norm()).item()


def build(args, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, batches) -> tuple:
    """(tp group or None for TP=1, runner, adapter keys) of this rank."""
    tp = None
    if args.tp > 1:
        timeout = timedelta(seconds=args.watchdog_s)  # a stuck collective fails instead of waiting forever
        tp = init_group(args.rank, args.tp, args.init_method, device, timeout)
        device = tp.device
    elif device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    say(args.rank, f"group ready on {device}")
    per = -(-(CTX + 1) // 16)
    config = EngineConfig(model=args.folder, device=device.type, dtype=str(dtype).split(".")[1], block_size=16,
                          num_kv_blocks=max(batches) * per, max_num_seqs=max(batches), max_model_len=CTX + 16,
                          max_num_batched_tokens=max(batches) * 2, enable_lora=args.adapters > 0,
                          max_loras=max(args.adapters, 1), max_lora_rank=16, lora_host_bytes=16 << 30,
                          cuda_graph_batch_sizes=batches)  # fmt: skip
    if tp is not None:
        model = random_sharded_model(cfg, tp, device, dtype)
    else:
        model = random_model(cfg, device, dtype)
    say(args.rank, "weights drawn; building the runner (kernel warm-up, graph capture)")
    runner = ModelRunner(config, model=model, model_config=cfg, tp=tp)
    say(args.rank, f"runner ready (graphs: {runner.graphs is not None})")
    keys = []
    if runner.lora is not None and tp is not None:  # every rank decides the same moves; it keeps its shard
        runner.lora.gpu.mirror = _OwnShard(cfg, tp)
    for i in range(args.adapters):
        weights = random_adapter(cfg, 16, dtype, seed=i, device=device)
        runner.lora.register(f"a{i}", "v1", Path("/nonexistent"), f"a{i}", weights)
        keys.append(f"a{i}@v1")
    for layer in runner.model.model.layers:  # random KV, never zeros
        layer.self_attn.k_cache.normal_()
        layer.self_attn.v_cache.normal_()
    return tp, runner, keys


def rank_main(args) -> None:
    """One rank: build the shard and runner, time every batch size; rank 0 writes the rows."""
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)  # stacks, then exit: never a silent hang
    device = torch.device(args.device)
    torch.set_num_threads(1 if device.type == "cpu" else min(8, torch.get_num_threads()))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig.from_dict(SHAPES[args.shape], max_model_len=CTX + 16)
    batches = (1, 4) if device.type == "cpu" else BATCHES
    tp, runner, keys = build(args, cfg, device, dtype, batches)
    device = runner.device
    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in runner.model.named_parameters() if "embed" not in n
    )
    kv_token = 2 * cfg.num_layers * runner.model_config.num_kv_heads * cfg.head_dim * dtype.itemsize
    bw = None
    if device.type == "cuda":
        src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        bw = 2 * src.numel() * 2 / median_ms(lambda: dst.copy_(src), device) / 1e6  # GB/s read + written
        del src, dst
        say(args.rank, f"copy bandwidth {bw:.0f} GB/s")
    rows, base_ms = [], {}
    with torch.inference_mode():
        for with_adapters in (False, True) if keys else (False,):
            for B in batches:
                batch = decode_batch(runner, B, keys if with_adapters else [])
                step_ms = median_ms(lambda batch=batch: runner.forward_logits(batch), device)
                comm_ms, reduce_ms = comm_time(tp, B, cfg, dtype) if tp is not None else (0.0, 0.0)
                n_adapters = min(B, len(keys)) if with_adapters else 0
                row = {"case": f"decode B={B} ctx={CTX}", "tp": args.tp, "batch": B, "adapters": n_adapters,
                       "step_ms": step_ms, "comm_ms": comm_ms, "all_reduce_us": reduce_ms * 1e3}  # fmt: skip
                if bw is not None:
                    read = weight_bytes + B * CTX * kv_token + n_adapters * adapter_bytes(cfg, args.tp)
                    row["floor_ms"] = read / bw / 1e6 + comm_ms
                    row["x_floor"] = step_ms / row["floor_ms"]
                if with_adapters:
                    row["x_base"] = step_ms / base_ms[B]
                else:
                    base_ms[B] = step_ms
                rows.append(row)
                say(args.rank, f"B={B} adapters={n_adapters}: step {step_ms:.3f} ms, comm {comm_ms:.3f} ms")
        check_b = 16 if device.type == "cuda" else 4
        graph_err = {"base": graph_vs_eager(runner, decode_batch(runner, check_b, []))}
        if keys:
            graph_err["adapters"] = graph_vs_eager(runner, decode_batch(runner, check_b, keys))
        say(args.rank, f"graph replay vs eager at B={check_b}: {graph_err}")
    if args.rank == 0:
        meta = {"shape": args.shape, "tensor_parallel_size": args.tp, "adapters": f"{args.adapters} x rank 16",
                "dtype": str(dtype), "device": torch.cuda.get_device_name(device) if bw else "cpu",
                "per-GPU weight GB": weight_bytes / 1e9, "copy GB/s": bw,
                "graphs captured": runner.graphs is not None,
                f"graph replay vs eager logits, rel. norm error (B={check_b})": graph_err}  # fmt: skip
        Path(args.result).write_text(json.dumps({"rows": rows, "meta": meta}))
    if tp is not None:  # the graphs hold the communicator: they go first
        release_graphs(runner)
        say(args.rank, f"left the group: {destroy_group(timeout_s=20)}")
    faulthandler.cancel_dump_traceback_later()
    say(args.rank, "done")
    sys.stdout.flush()
    os._exit(0)  # nothing left worth finishing (and no group destructor to wait on)


def launch(args, tp: int, folder: Path, result: Path) -> dict:
    """Run ``tp`` rank processes; the first one to fail stops the others. Returns rank 0's result."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    common = ["--shape", args.shape, "--tp", str(tp), "--adapters", str(args.adapters), "--device", args.device,
              "--init-method", init, "--folder", str(folder), "--result", str(result),
              "--watchdog-s", str(args.watchdog_s)]  # fmt: skip
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *common], env=os.environ.copy())
             for r in range(tp)]  # fmt: skip
    deadline = time.monotonic() + args.watchdog_s + 30
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                raise RuntimeError(f"bench ranks exited with {codes} (the others were stopped)")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench ranks still running after {args.watchdog_s + 30} s: {codes}")
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return json.loads(result.read_text())


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench/run.py tp")
    parser.add_argument("--shape", default="llama3-70b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=0)
    parser.add_argument("--with-tp1", action="store_true", help="also time the shape on one GPU, no group")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--watchdog-s", type=int, default=300, help="a rank still running then dumps and exits"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "model")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(SHAPES[args.shape]))  # no weights: random, in memory
        out = launch(args, args.tp, folder, Path(tmp, "result.json"))
        if args.with_tp1:
            single = launch(args, 1, folder, Path(tmp, "result1.json"))
            tp1 = {(r["batch"], r["adapters"]): r["step_ms"] for r in single["rows"]}
            for r in out["rows"]:
                r["tp1_over_tpN"] = tp1[(r["batch"], r["adapters"])] / r["step_ms"]
            out["rows"] += single["rows"]
            out["meta"]["TP=1 run"] = single["meta"]
    columns, notes = columns_and_notes(args.adapters, args.with_tp1)
    return {
        "title": f"Tensor-parallel decode step: {args.shape}, TP={args.tp}, {args.adapters} adapters",
        "columns": columns,
        "rows": out["rows"],
        "meta": out["meta"],
        "notes": notes,
    }


def columns_and_notes(adapters: int, with_tp1: bool) -> tuple[list[str], list[str]]:
    columns = ["case", "tp", "adapters", "step_ms", "comm_ms", "all_reduce_us", "floor_ms", "x_floor"]
    columns += ["x_base"] if adapters else []
    columns += ["tp1_over_tpN"] if with_tp1 else []
    notes = [
        "step: ModelRunner.forward_logits on every rank (host preparation of the inputs included; CUDA graph "
        "when the batch fits), median of 20.",
        "comm: (2 per layer + 1) all-reduces of [B, H] and one all-gather of the logits, alone, each set"
        " captured in a CUDA graph like the step's and timed by replay.",
        "floor: (per-GPU weights but the embedding + per-GPU KV of the batch + per-GPU shards of the"
        " step's distinct adapters) / copy bandwidth + comm.",
    ]
    if adapters:
        notes.append(
            "adapters: distinct adapters in the batch (one per sequence, round-robin); x_base: over the "
            "base-only step of the same batch."
        )
    if with_tp1:
        notes.append("tp1_over_tpN: the single-GPU engine's step (no process group) over this row's step.")
    return columns, notes


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for flag in ("--shape", "--device", "--init-method", "--folder", "--result"):
        p.add_argument(flag)
    for flag in ("--rank", "--tp", "--adapters", "--watchdog-s"):
        p.add_argument(flag, type=int)
    rank_main(p.parse_args())
