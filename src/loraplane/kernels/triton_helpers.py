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


@triton.jit
def _pool_of_slice(sl, bt_ptr, stride_br, page_table_ptr, ranks_ptr, scales_ptr, bo1, bo2, bo3, bs1, bs2, bs3,
                   po1, po2, po3, ro1, ro2, ro3, so1, so2, so3):  # fmt: skip
    """An expand's tensors for slice ``sl`` when each slice is its own pool: B^T, its row stride, page
    table, ranks and scales at element offsets (bo, po, ro, so) and row stride bs of pools 1..3 from pool
    0's (the arguments)."""
    return (
        bt_ptr + _pick_rt(sl, 0, bo1, bo2, bo3),
        _pick_rt(sl, stride_br, bs1, bs2, bs3),
        page_table_ptr + _pick_rt(sl, 0, po1, po2, po3),
        ranks_ptr + _pick_rt(sl, 0, ro1, ro2, ro3),
        scales_ptr + _pick_rt(sl, 0, so1, so2, so3),
    )


@triton.jit
def _chunk_of(c, N_CHUNK: tl.constexpr, NUM_SLICES: tl.constexpr, CB1: tl.constexpr, CB2: tl.constexpr,
              CB3: tl.constexpr, OFF0: tl.constexpr, OFF1: tl.constexpr, OFF2: tl.constexpr, OFF3: tl.constexpr,
              END0: tl.constexpr, END1: tl.constexpr, END2: tl.constexpr, END3: tl.constexpr, DY0: tl.constexpr,
              DY1: tl.constexpr, DY2: tl.constexpr, DY3: tl.constexpr):  # fmt: skip
    """Expand column chunk ``c`` (launch_config.slice_geometry): (its slice, its first packed B^T column, the
    slice's end column, the offset from packed to y columns)."""
    sl = _slice_of(c, NUM_SLICES, CB1, CB2, CB3)
    c0 = c * N_CHUNK + _pick(sl, OFF0, OFF1, OFF2, OFF3)
    return sl, c0, _pick(sl, END0, END1, END2, END3), _pick(sl, DY0, DY1, DY2, DY3)


@triton.jit
def _first_rows(pt, slot, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, BLOCK_R: tl.constexpr):
    """Physical rows of ``slot``'s first BLOCK_R rank rows, asked for before its rank is known (rows past
    the rank are masked where A or B^T is read)."""
    offs_r = tl.arange(0, BLOCK_R)
    return _rows(pt, slot, offs_r, offs_r < MAX_PAGES * PAGE, PAGE, MAX_PAGES)


@triton.jit
def _tile_tokens(order_ptr, start, count, BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """The tile's rows [BM] (int64) for the dot path; without DOT nothing is read."""
    offs_m = tl.arange(0, BLOCK_M)
    if DOT:
        toks = tl.load(order_ptr + start + offs_m, mask=offs_m < count, other=0).to(tl.int64)
    else:
        toks = offs_m.to(tl.int64)
    return toks
