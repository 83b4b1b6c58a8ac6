"""Start-up compile cost of the LoRA kernels, measured without a GPU.

An engine with adapters compiles one Triton kernel per distinct launch shape before it serves: the captured
decode launches while its CUDA graphs are captured, the eager (prefill and mixed) launches in the start-up
warm-up (``engine/model/lora_warmup.py``). On a machine with no Triton cache that is most of the start.

This benchmark lists those launch shapes as the warm-up does (``fast_launch.compile_only``), through the
engine's pools and entry points over the metadata that ``lora_warmup.warm_plan`` asks for and the capture
policy's decode metadata, for one layer of a model shape on the CPU; then it compiles each one ahead of time
for a GPU target (Triton's ``compile`` with an explicit target needs no GPU; compiling is CPU work on the
GPU machine too). It reports each shape's compile time and the total, sequential and over ``--threads``
threads.

    python bench/run.py compile --out DIR [--target 90] [--threads N] [--only decode|eager] [--limit N]

What it leaves out: the prefill split classes follow the CPU's stand-in SM count (4), not the GPU's, and
adapters of a few modules only (q and v) launch the packed projections with fewer slices; so the eager count
is indicative, the captured decode count exact for all-module adapters.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not the interpreter's

import torch  # noqa: E402
from shapes import LLAMA3_8B  # noqa: E402

from loraplane.engine.lora.layers import PROJECTIONS, build_pools  # noqa: E402
from loraplane.engine.model.lora_warmup import warm_plan  # noqa: E402
from loraplane.engine.model.model_config import ModelConfig  # noqa: E402
from loraplane.kernels import lora_apply, lora_apply_many  # noqa: E402
from loraplane.kernels.fast_launch import compile_only  # noqa: E402
from loraplane.kernels.metadata import LoRABatchMeta  # noqa: E402

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64"}  # fmt: skip


def signature(fn, args: tuple, constexprs: dict) -> tuple[dict, dict, dict]:
    """Triton's signature, divisibility attributes and added compile-time values for ``args`` (the
    kernel's run-time parameters in order), as its JIT specializes them: pointers 16-byte aligned and ints
    that are multiples of 16 (0 too) marked divisible, ints equal to 1 made constants; parameters it is told
    not to specialize left alone."""
    names = [n for n in fn.arg_names if n not in constexprs]
    plain = {p.name for p in getattr(fn, "params", ()) if getattr(p, "do_not_specialize", False)}
    sig, attrs, ones = {}, {}, {}
    for name, a in zip(names, args, strict=True):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _DTYPES[a.dtype]
            aligned = a.data_ptr() % 16 == 0
        elif name not in plain and a == 1:
            sig[name], ones[name] = "constexpr", 1
            continue
        else:
            sig[name] = "i32" if -(1 << 31) <= a < (1 << 31) else "i64"
            aligned = name not in plain and a % 16 == 0
        if aligned:
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, attrs, ones


def census(only: str, max_rank: int = 64, seqs: int = 256, tokens: int = 8192) -> dict:
    """{Triton's key: (label, fn, constexprs, options, signature, attributes)} of every distinct launch shape:
    the engine's pools (one layer of the Llama-3-8B shape) and entry points (``lora_apply_many`` for the
    packed projections, ``lora_apply`` for the others, as ``LoRALinear`` calls them), their launches listed
    by ``fast_launch.compile_only``."""
    cfg = ModelConfig.from_dict({**LLAMA3_8B, "num_hidden_layers": 1}, max_model_len=2048)
    pools = build_pools(cfg, seqs, max_rank, torch.bfloat16, torch.device("cpu"))
    found: dict = {}

    def add(kind: str, meta: LoRABatchMeta, rows: int, store: bool = False) -> None:
        for (_, proj), members in PROJECTIONS.items():
            widths = [pools[m].modules[m].out_dims[0] for m in members]
            x = torch.zeros(rows, pools[members[0]].modules[members[0]].in_dim, dtype=torch.bfloat16)
            y = torch.zeros(rows, sum(widths), dtype=torch.bfloat16)
            with compile_only() as queued:
                if len(members) > 1:
                    targets = [(pools[m], m, sum(widths[:i])) for i, m in enumerate(members)]
                    lora_apply_many(y, x, targets, 0, meta, backend="triton", store=store)
                else:
                    lora_apply(y, x, pools[proj], 0, proj, meta, backend="triton", store=store)
            for launch, args in queued.values():
                sig, attrs, ones = signature(launch.fn, args, launch.constexprs)
                constexprs = {**launch.constexprs, **ones}
                key = (launch.fn, tuple(sorted(constexprs.items())), tuple(sorted(launch.options.items())),
                       tuple(sig.items()), tuple(sorted(attrs)))  # fmt: skip
                found.setdefault(key, (f"{kind} {proj} {launch.fn.__name__}", launch.fn, constexprs,
                                       launch.options, sig, attrs))  # fmt: skip

    if only in ("all", "decode"):
        meta = LoRABatchMeta(seqs, "cpu", tile_m=16, capture=True, max_rank=max_rank)
        meta.build([], [0] * seqs)
        add("captured", meta, seqs)
    if only in ("all", "eager"):
        kinds = {"decode": (seqs, 16), "prefill": (tokens, 64)}
        for kind, rank, reqs in warm_plan(max_rank, kinds, list(range(seqs)), sms=0):
            ranks = [0] * seqs
            for slot, _ in reqs:
                ranks[slot] = rank
            capacity, tile_m = kinds[kind]
            meta = LoRABatchMeta(capacity, "cpu", tile_m=tile_m, max_rank=max_rank).build(reqs, ranks)
            for store in (False, True):
                add(f"eager {kind} r{rank} t{meta.host_num_tiles}", meta, meta.num_tokens, store)
    return found


def compile_one(entry: tuple, arch: int) -> tuple[float, int]:
    """Seconds to compile one launch shape for ``arch`` (no cache: a fresh TRITON_CACHE_DIR), and its
    cubin's bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _, fn, constexprs, options, sig, attrs = entry
    opts = {k: v for k, v in options.items() if k in ("num_warps", "num_stages", "launch_pdl")}
    t0 = time.perf_counter()
    kernel = triton.compile(
        ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=opts
    )
    return time.perf_counter() - t0, len(kernel.asm.get("cubin", b""))


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=int, default=90, help="compute capability, as 90 for sm_90 (Hopper)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", choices=("all", "decode", "eager"), default="all")
    ap.add_argument("--limit", type=int, default=0, help="compile at most this many shapes (0: all)")
    args = ap.parse_args(argv)
    import tempfile

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="lp-compile-")  # every shape compiles afresh
    entries = list(census(args.only).values())
    listed = len(entries)
    if args.limit:
        entries = entries[: args.limit]
    t0 = time.perf_counter()
    results = [compile_one(e, args.target) for e in entries]  # sequential: each shape's own time
    seq = time.perf_counter() - t0
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="lp-compile-")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(lambda e: compile_one(e, args.target), entries))
    par = time.perf_counter() - t0
    rows = sorted(({"shape": e[0], "constexprs": _short(e[2]), "compile_s": round(s, 2), "cubin_kb": b // 1000}
                   for e, (s, b) in zip(entries, results, strict=True)), key=lambda r: -r["compile_s"])  # fmt: skip
    return {
        "title": f"LoRA kernel compile cost, Llama-3-8B shapes, sm_{args.target}, on this CPU",
        "columns": ["shape", "compile_s", "cubin_kb", "constexprs"],
        "rows": rows,
        "meta": {
            "listed": listed,
            "compiled": len(entries),
            "sequential_s": round(seq, 1),
            f"threads_{args.threads}_s": round(par, 1),
            "cpus": os.cpu_count(),
            "only": args.only,
        },  # fmt: skip
        "notes": [
            "compile_s: one shape alone, sequentially, with no Triton cache",
            "a shape is (kernel, compile-time values, options, argument specialization)",
        ],  # fmt: skip
    }


def _short(constexprs: dict) -> str:
    keep = ("SPLIT", "BLOCK_M", "BLOCK_R", "BLOCK_K", "BLOCK_N", "N_CHUNK", "DOT", "STORE", "NUM_SLICES")
    return " ".join(f"{k}={v}" for k, v in constexprs.items() if k in keep)
