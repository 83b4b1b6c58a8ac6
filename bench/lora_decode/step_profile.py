"""Where a decode step's GPU time goes: one forward (CUDA-graph replay) under torch.profiler, its
kernels split into the multi-LoRA kernels and everything else, and the idle time between them."""

from __future__ import annotations

import torch

LORA_KERNELS = ("_shrink_kernel", "_expand_kernel", "_fused_kernel")


def step_profile(forward) -> dict:
    """ms of one ``forward()`` on the device: span (first kernel start to last kernel end), the LoRA
    kernels' and the other kernels' busy time, the gaps between kernels, and kernel counts."""
    from torch.profiler import ProfilerActivity, profile

    forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
         and "Memset" not in e.name),
        key=lambda e: e.time_range.start,
    )  # fmt: skip
    if not kernels:
        return {"n_kernels": 0}
    lora = [e for e in kernels if any(k in e.name for k in LORA_KERNELS)]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    lora_ms = sum(e.time_range.elapsed_us() for e in lora) / 1e3
    # Kernels on a side stream (the shrink beside the base GEMM) overlap others: the span runs to the last
    # end, and gaps_ms (span - busy) goes negative by the time they overlapped.
    span = (max(e.time_range.end for e in kernels) - kernels[0].time_range.start) / 1e3
    return {"span_ms": span, "lora_kernel_ms": lora_ms, "other_kernel_ms": busy - lora_ms,
            "gaps_ms": span - busy, "n_kernels": len(kernels), "n_lora_kernels": len(lora)}  # fmt: skip
