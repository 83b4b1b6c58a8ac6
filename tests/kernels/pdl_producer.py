"""A producer kernel for the programmatic-dependent-launch tests: it lets the kernel after it start at once
(``launch_dependents`` first thing), works for a while, and only then writes its output. A consumer that
reads that output before its ``griddepcontrol.wait`` sees what was there before: the tests put NaN there.
A plain ``Tensor.copy_`` would not do: a same-dtype device copy is a memcpy, which no kernel overlaps."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.kernels.pdl import launch_dependents, pdl_available, pdl_option, wait_for_kernel_ahead

BLOCK = 1024


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, ROUNDS: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    wait_for_kernel_ahead(GDC)
    launch_dependents(GDC)  # the next kernel's programs may start now, while ours still work
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for _ in range(ROUNDS):  # dependent work: the store below lands microseconds after the start
        acc = acc * 1.0000001 + 1e-30
        acc = acc / 1.0000001 - 1e-30
    tl.store(dst_ptr + offs, acc.to(dst_ptr.dtype.element_ty), mask=mask)


def late_copy(dst: torch.Tensor, src: torch.Tensor, rounds: int = 2000) -> None:
    """dst <- src (contiguous, same shape) by a kernel launched with programmatic dependent launch where
    the device has it, which signals its dependents before it writes."""
    assert dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape
    gdc = pdl_available(dst)
    n = dst.numel()
    _late_copy_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, ROUNDS=rounds, BLOCK=BLOCK, GDC=gdc, num_warps=4,
                                                **pdl_option(gdc))  # fmt: skip
