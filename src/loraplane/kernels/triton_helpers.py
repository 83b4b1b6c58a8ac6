"""Small Triton device functions shared by the shrink and expand kernels (triton_kernels.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows(page_table_ptr, slot, j, mask, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr):
    """Physical row (int64) of rank-rows ``j`` of ``slot``."""
    page = tl.load(page_table_ptr + slot * MAX_PAGES + j // PAGE, mask=mask, other=0)
    return page.to(tl.int64) * PAGE + j % PAGE


@triton.jit
def _aligned(stride, ALIGN: tl.constexpr):
    """``stride`` itself, written so that the compiler knows it is a multiple of ALIGN (the launcher
    checked). Triton only knows strides divisible by 16; a row of 3784 bf16 is still 16-byte aligned."""
    if ALIGN > 1:
        stride = (stride // ALIGN) * ALIGN
    return stride


@triton.jit
def _pick_rt(s, v0, v1, v2, v3):
    """v[s] for a run-time slice index (scalar or vector) over run-time values."""
    return tl.where(s == 1, v1, tl.where(s == 2, v2, tl.where(s == 3, v3, v0)))


@triton.jit
def _pick(s, V0: tl.constexpr, V1: tl.constexpr, V2: tl.constexpr, V3: tl.constexpr):
    """V[s] for a run-time slice index over compile-time values: no memory access, and terms whose value
    equals V0 fold away (the packed layout's offsets are all 0), so the compiler still sees alignment."""
    t = V0 + (s == 1).to(tl.int32) * (V1 - V0)
    return t + (s == 2).to(tl.int32) * (V2 - V0) + (s == 3).to(tl.int32) * (V3 - V0)


@triton.jit
def _slice_of(c, NUM_SLICES: tl.constexpr, CB1: tl.constexpr, CB2: tl.constexpr, CB3: tl.constexpr):
    """The slice that owns expand column chunk ``c``: slice s owns chunks [CB_s, CB_s+1) (CB_0 = 0)."""
    sl = c * 0
    if NUM_SLICES > 1:
        sl += (c >= CB1).to(tl.int32)
    if NUM_SLICES > 2:
        sl += (c >= CB2).to(tl.int32)
    if NUM_SLICES > 3:
        sl += (c >= CB3).to(tl.int32)
    return sl
