"""torch.profiler timelines of single engine steps, summarised as a short markdown note per step kind:
wall time per step, GPU busy time (sum of kernel and copy durations), the top kernels, the CUDA runtime calls
that block the host, and (for the mixed step) every host synchronisation that torch reports.

    profile_steps(runner, out_dir) -> writes out_dir/profile-decode.md and out_dir/profile-mixed.md
"""

from __future__ import annotations

import statistics
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from floor import mixed_batches, wall_ms  # noqa: E402 (bench/engine on sys.path)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMalloc",
            "cudaFree", "cudaHostAlloc")  # fmt: skip
TOP = 14


def _short(name: str) -> str:
    name = name.replace("void ", "")
    return name if len(name) <= 90 else name[:87] + "..."


def profile_step(fn, iters: int = 3) -> dict:
    """Kernels (device events) and blocking runtime calls of `iters` calls of fn, per call."""
    fn()
    torch.cuda.synchronize()
    walls = [wall_ms(fn) for _ in range(iters)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    runtime: dict[str, list[float]] = defaultdict(list)
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            kernels[_short(evt.name)].append(evt.time_range.elapsed_us() / 1e3)
        elif evt.name.startswith(BLOCKING):
            runtime[evt.name].append(evt.time_range.elapsed_us() / 1e3)
    busy = sum(sum(v) for v in kernels.values()) / iters
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    return {
        "wall_ms": statistics.median(walls),
        "busy_ms": busy,
        "launches": sum(len(v) for v in kernels.values()) / iters,
        "top": [(n, len(v) / iters, sum(v) / iters) for n, v in top],
        "blocking": {n: (len(v) / iters, sum(v) / iters) for n, v in runtime.items()},
    }


def sync_sites(fn) -> list[str]:
    """Where one call of fn makes the host wait for the device (torch's sync debug mode, as warnings)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sorted(
        {f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:100]}" for w in caught}
    )


def _section(title: str, p: dict) -> list[str]:
    lines = [f"### {title}", "",
             f"wall {p['wall_ms']:.2f} ms per step; GPU busy {p['busy_ms']:.2f} ms "
             f"({100 * p['busy_ms'] / p['wall_ms']:.0f}% of wall); {p['launches']:.0f} kernels and copies", "",
             "| kernel | per step | ms per step | % of busy |", "|---|---|---|---|"]  # fmt: skip
    for name, count, ms in p["top"]:
        lines.append(f"| `{name}` | {count:g} | {ms:.3f} | {100 * ms / max(p['busy_ms'], 1e-9):.1f} |")
    if p["blocking"]:
        calls = ", ".join(f"{n} x{c:g} ({ms:.2f} ms)" for n, (c, ms) in sorted(p["blocking"].items()))
        lines += ["", f"Host calls that can block, per step: {calls}."]
    return lines + [""]


def profile_steps(runner, decode_batch, out_dir: Path) -> dict:
    """decode_batch: a decode-only ScheduledBatch (B=64 at ctx 512 in the benchmark)."""
    out_dir = Path(out_dir)
    graph = profile_step(lambda: runner.execute(decode_batch))
    graphs, runner.graphs = runner.graphs, None
    try:
        eager = profile_step(lambda: runner.execute(decode_batch))
    finally:
        runner.graphs = graphs
    mixed, prefill, _ = mixed_batches(runner, 64)
    mix = profile_step(lambda: runner.execute(mixed))
    pre = profile_step(lambda: runner.execute(prefill))
    syncs = sync_sites(lambda: runner.execute(mixed))
    B = len(decode_batch.chunks)
    head = ["## Profile: one engine step (torch.profiler, H200, Llama-3-8B shape, random bf16 weights)", "",
            "Reproduce: `python bench/run.py engine --profile DIR` (see bench/engine/step_profile.py). Kernel times are",
            "device durations from CUPTI; 'GPU busy' sums them, so wall minus busy is time the GPU waited for the",
            "host.", ""]  # fmt: skip
    dec = head + _section(f"Decode B={B}, ctx 512, CUDA graph (runner.execute)", graph)
    dec += _section(f"Decode B={B}, ctx 512, eager (same kernels launched one by one)", eager)
    (out_dir / "profile-decode.md").write_text("\n".join(dec))
    mx = head + _section(f"Mixed step: 64 decode rows + {prefill.num_tokens} prefill tokens", mix)
    mx += _section(f"The same prefill alone ({prefill.num_tokens} tokens)", pre)
    mx += ["### Host synchronisations inside one mixed step (torch.cuda sync debug mode)", ""]
    mx += [f"- {s}" for s in syncs] or ["- none"]
    (out_dir / "profile-mixed.md").write_text("\n".join(mx) + "\n")
    summary = {k: {"wall_ms": round(v["wall_ms"], 2), "busy_ms": round(v["busy_ms"], 2)}
               for k, v in (("decode_graph", graph), ("decode_eager", eager), ("mixed", mix), ("prefill", pre))}  # fmt: skip
    return summary | {"sync_sites": syncs}
