"""Decode-shaped shrink and expand: no program loops over columns; each makes two rounds of loads.

A decode step's tiles hold one token each when its adapters are distinct (the case that costs most), and
then the general kernels (triton_kernels.py) spend their time on latency, not bytes: each program walks
``K_PER_SPLIT / BLOCK_K`` or ``N_CHUNK / BLOCK_N`` dependent iterations of small loads, and pads the one
token to a 16-row ``tl.dot``. Here the grid covers the work instead:

- shrink: program (tile, slice x K block) reads one [BLOCK_R, BLOCK_K] block of A per rank chunk and
  writes its partial v to plane ``k`` (the planes are summed by expand, as in the general kernels);
- expand: program (tile, column block) reads one [BLOCK_R, BLOCK_N] block of B^T per rank chunk and adds
  into y once.

A one-token tile takes a vector path (multiply and reduce in float32, no 16-row padding); a tile of
several tokens of one adapter takes ``tl.dot`` (``LaunchConfig.decode_dot``), so that adapter's A and B
are read once for all of them, or the vector path a token at a time. With the dot path both are in the
kernel behind a run-time test, since a captured CUDA graph serves any batch.

Such a program's time is its chain of dependent loads, not its bytes: so everything that follows from the
tile alone (rank, scale, first token, the first rank chunk's page rows) is asked for in one round, then
A or B^T, x or v, and y in a second, then the store.
Argument lists are the general kernels' (``triton_ops.shrink_args`` / ``expand_args``), so the plans of
triton_apply.py launch either.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from loraplane.kernels.fast_launch import FastLaunch
from loraplane.kernels.launch_config import LaunchConfig, align_hint, pow2_at_least
from loraplane.kernels.metadata import LoRABatchMeta
from loraplane.kernels.pdl import launch_dependents, pdl_available, pdl_option, wait_for_kernel_ahead
from loraplane.kernels.triton_decode_expand import _expand_dot, _expand_rows
from loraplane.kernels.triton_helpers import (
    _aligned,
    _chunk_of,
    _first_rows,
    _pick_rt,
    _pool_of_slice,
    _rows,
    _tile_tokens,
)
from loraplane.kernels.triton_ops import _precision, expand_geometry

__all__ = ["decode_expand_launch", "decode_shrink_launch", "decode_split"]


@triton.jit
def _a_block(a_ptr, a_off, stride_ar, phys, kk, r_mask, k_mask):
    """[BR, BK] of A: rank rows ``phys`` (physical), input columns ``kk``."""
    return tl.load(a_ptr + a_off + phys[:, None] * stride_ar + kk[None, :], mask=r_mask[:, None] & k_mask[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _shrink_token(x_ptr, stride_xt, tok, kk, k_mask, at0, a_ptr, a_off, stride_ar, pt, slot, rank, v_plane,
                  stride_vt, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    # v[tok, r] = sum_k A[r, k] x[tok, k] over this program's columns, in float32; at0: A's first rank chunk.
    offs_r = tl.arange(0, BLOCK_R)
    xv = tl.load(x_ptr + tok * stride_xt + kk, mask=k_mask, other=0.0).to(tl.float32)  # [BK]
    tl.store(v_plane + tok * stride_vt + offs_r, tl.sum(at0.to(tl.float32) * xv[None, :], axis=1),
             mask=offs_r < rank)  # fmt: skip
    for r0 in range(BLOCK_R, rank, BLOCK_R):  # ranks above BLOCK_R
        rr = r0 + offs_r
        r_mask = rr < rank
        phys = _rows(pt, slot, rr, r_mask, PAGE, MAX_PAGES)
        at = _a_block(a_ptr, a_off, stride_ar, phys, kk, r_mask, k_mask)  # [BR, BK]
        tl.store(v_plane + tok * stride_vt + rr, tl.sum(at.to(tl.float32) * xv[None, :], axis=1), mask=r_mask)


@triton.jit
def _shrink_rows(x_ptr, stride_xt, order_ptr, start, count, tok0, kk, k_mask, a_ptr, a_off, stride_ar, phys0, pt,
                 slot, rank, v_plane, stride_vt, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
                 BLOCK_R: tl.constexpr):  # fmt: skip
    # A token at a time: multiply and reduce (a one-token tile pads nothing). A's first rank chunk is read
    # once for the tile's tokens, in the same round of loads as the first token's x.
    r_mask = tl.arange(0, BLOCK_R) < rank
    at0 = _a_block(a_ptr, a_off, stride_ar, phys0, kk, r_mask, k_mask)  # [BR, BK]
    _shrink_token(x_ptr, stride_xt, tok0, kk, k_mask, at0, a_ptr, a_off, stride_ar, pt, slot, rank, v_plane,
                  stride_vt, PAGE, MAX_PAGES, BLOCK_R)  # fmt: skip
    for m in range(1, count):
        tok = tl.load(order_ptr + start + m).to(tl.int64)
        # A again (a cache hit): holding the first chunk across the loop would double the registers
        at = _a_block(a_ptr, a_off, stride_ar, phys0, kk, r_mask, k_mask)
        _shrink_token(x_ptr, stride_xt, tok, kk, k_mask, at, a_ptr, a_off, stride_ar, pt, slot, rank, v_plane,
                      stride_vt, PAGE, MAX_PAGES, BLOCK_R)  # fmt: skip


@triton.jit
def _shrink_dot_chunk(x_ptr, stride_xt, toks, m_mask, k0, K, a_ptr, a_off, stride_ar, phys, r_mask,
                      BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_K: tl.constexpr,
                      PRECISION: tl.constexpr):  # fmt: skip
    # [BM, BR] of x A^T over input columns [k0, k0 + BLOCK_K), in DOT_K-column pieces (small MMA operands),
    # unrolled so that every piece's loads can be in flight at once.
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for q0 in tl.static_range(0, BLOCK_K, DOT_K):
        kk = k0 + q0 + tl.arange(0, DOT_K)  # [DK]
        k_mask = kk < K
        xt = tl.load(x_ptr + toks[:, None] * stride_xt + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                     other=0.0)  # [BM, DK]  # fmt: skip
        at = _a_block(a_ptr, a_off, stride_ar, phys, kk, r_mask, k_mask)  # [BR, DK]
        acc = tl.dot(xt, tl.trans(at), acc=acc, input_precision=PRECISION)
    return acc


@triton.jit
def _shrink_dot(x_ptr, stride_xt, toks, count, k0, K, a_ptr, a_off, stride_ar, phys0, pt, slot, rank, v_plane,
                stride_vt, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_K: tl.constexpr, DOT_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    # The tile's tokens together: each block of A is read once for all of them.
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = tl.arange(0, BLOCK_M) < count
    r_mask = offs_r < rank
    acc = _shrink_dot_chunk(x_ptr, stride_xt, toks, m_mask, k0, K, a_ptr, a_off, stride_ar, phys0, r_mask, BLOCK_M,
                            BLOCK_R, BLOCK_K, DOT_K, PRECISION)  # fmt: skip
    tl.store(
        v_plane + toks[:, None] * stride_vt + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :]
    )
    for r0 in range(BLOCK_R, rank, BLOCK_R):  # ranks above BLOCK_R
        rr = r0 + offs_r
        r_mask = rr < rank
        phys = _rows(pt, slot, rr, r_mask, PAGE, MAX_PAGES)
        acc = _shrink_dot_chunk(x_ptr, stride_xt, toks, m_mask, k0, K, a_ptr, a_off, stride_ar, phys, r_mask,
                                BLOCK_M, BLOCK_R, BLOCK_K, DOT_K, PRECISION)  # fmt: skip
        tl.store(
            v_plane + toks[:, None] * stride_vt + rr[None, :], acc, mask=m_mask[:, None] & r_mask[None, :]
        )


@triton.jit(do_not_specialize=["tile_bound"])
def _shrink_decode_kernel(
    x_ptr, stride_xt, a_ptr, stride_as, stride_ar, v_ptr, stride_vk, stride_vs, stride_vt,
    tiles_ptr, tile_bound, order_ptr, page_table_ptr, ranks_ptr, K,
    ao1, ao2, ao3, po1, po2, po3, ro1, ro2, ro3,
    SPLIT: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, X_ALIGN: tl.constexpr,
    A_ALIGN: tl.constexpr, K_ALIGN: tl.constexpr, MULTI: tl.constexpr, DOT: tl.constexpr, DOT_K: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    # program (tile, s * SPLIT + k): slice s, input columns [k * BLOCK_K, (k + 1) * BLOCK_K) -> v plane k.
    # MULTI: slice s from its own pool, at element offsets ao_s (A), po_s (page table), ro_s (ranks).
    # DOT: tiles of several tokens take tl.dot; else every tile goes a token at a time.
    # GDC: launched with programmatic dependent launch (kernels/pdl.py). What a program reads before its
    # wait is the step's metadata (tiles, token order, ranks, scales, page table): written by copies from
    # the host before the step, or by a pool's release between steps, which a kernel that waits at its top
    # (the decoder's norm) always follows; x, A, v and y come after the wait.
    launch_dependents(GDC)  # the expand after us may start its programs: they wait for all of ours
    stride_xt = _aligned(stride_xt, X_ALIGN)
    stride_as = _aligned(stride_as, A_ALIGN)
    stride_ar = _aligned(stride_ar, A_ALIGN)
    K = _aligned(K, K_ALIGN)
    tile = tl.program_id(0)
    s = tl.program_id(1) // SPLIT
    kb = tl.program_id(1) % SPLIT
    slot = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    if MULTI:
        a_off = _pick_rt(s, 0, ao1, ao2, ao3).to(tl.int64)
        pt = page_table_ptr + _pick_rt(s, 0, po1, po2, po3)
        rank = tl.load(ranks_ptr + _pick_rt(s, 0, ro1, ro2, ro3) + slot)
    else:
        a_off = s.to(tl.int64) * stride_as
        pt = page_table_ptr
        rank = tl.load(ranks_ptr + slot)
    # A program's time is its chain of dependent loads, so all that follows from the tile alone is asked
    # for in one round with the rank: the first token, the dot path's tokens, the first rank chunk's page
    # rows. Then A and x in one more round, and the store.
    tok0 = tl.load(order_ptr + start, mask=count > 0, other=0).to(tl.int64)
    toks = _tile_tokens(order_ptr, start, count, BLOCK_M, DOT)
    phys0 = _first_rows(pt, slot, PAGE, MAX_PAGES, BLOCK_R)
    wait_for_kernel_ahead(GDC)
    # count 0: a tile slot past the step's last; rank 0: an adapter without this pool's module
    if (count > 0) & (rank > 0):
        kk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        v_plane = v_ptr + kb * stride_vk + s * stride_vs
        if not (DOT and count > 1):  # without DOT the dot path is not compiled
            _shrink_rows(x_ptr, stride_xt, order_ptr, start, count, tok0, kk, k_mask, a_ptr, a_off, stride_ar,
                         phys0, pt, slot, rank, v_plane, stride_vt, PAGE, MAX_PAGES, BLOCK_R)  # fmt: skip
        else:
            _shrink_dot(x_ptr, stride_xt, toks, count, kb * BLOCK_K, K, a_ptr, a_off, stride_ar, phys0, pt, slot,
                        rank, v_plane, stride_vt, PAGE, MAX_PAGES, BLOCK_M, BLOCK_R, BLOCK_K, DOT_K,
                        PRECISION)  # fmt: skip


@triton.jit(do_not_specialize=["tile_bound"])
def _expand_decode_kernel(
    v_ptr, stride_vk, stride_vs, stride_vt, x_ptr, stride_xt, a_ptr, stride_as, stride_ar, K,
    bt_ptr, stride_br, y_ptr, stride_yt, tiles_ptr, tile_bound, order_ptr, page_table_ptr, ranks_ptr,
    scales_ptr, bo1, bo2, bo3, bs1, bs2, bs3, po1, po2, po3, ro1, ro2, ro3, so1, so2, so3,
    NUM_SLICES: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, PAGE: tl.constexpr,
    MAX_PAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, Y_ALIGN: tl.constexpr, B_ALIGN: tl.constexpr,
    RAGGED: tl.constexpr, CB1: tl.constexpr, CB2: tl.constexpr, CB3: tl.constexpr,
    OFF0: tl.constexpr, OFF1: tl.constexpr, OFF2: tl.constexpr, OFF3: tl.constexpr,
    END0: tl.constexpr, END1: tl.constexpr, END2: tl.constexpr, END3: tl.constexpr,
    DY0: tl.constexpr, DY1: tl.constexpr, DY2: tl.constexpr, DY3: tl.constexpr, MULTI: tl.constexpr,
    DOT: tl.constexpr, DOT_N: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    # program (tile, c): column block c, of slice sl (blocks [CB_sl, CB_sl+1)); packed B^T columns
    # c * BLOCK_N + OFF_sl onwards, up to END_sl; y columns DY_sl further (launch_config.slice_geometry with
    # n_chunk = BLOCK_N). x, a and K are the general kernel's (unused here). MULTI: as _expand_kernel.
    stride_yt = _aligned(stride_yt, Y_ALIGN)
    tile = tl.program_id(0)
    c = tl.program_id(1)
    sl, n0, c_end, dy = _chunk_of(c, BLOCK_N, NUM_SLICES, CB1, CB2, CB3, OFF0, OFF1, OFF2, OFF3, END0, END1, END2,
                                  END3, DY0, DY1, DY2, DY3)  # fmt: skip
    nn = n0 + tl.arange(0, BLOCK_N)  # [BN]
    if MULTI:
        bt_ptr, stride_br, page_table_ptr, ranks_ptr, scales_ptr = _pool_of_slice(
            sl, bt_ptr, stride_br, page_table_ptr, ranks_ptr, scales_ptr,
            bo1, bo2, bo3, bs1, bs2, bs3, po1, po2, po3, ro1, ro2, ro3, so1, so2, so3,
        )  # fmt: skip
    stride_br = _aligned(stride_br, B_ALIGN)
    slot = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    # As in the shrink: one round of loads for what follows from the tile alone, then B^T, v and y in one
    # more round, then the store.
    rank = tl.load(ranks_ptr + slot)
    scale = tl.load(scales_ptr + slot)
    tok0 = tl.load(order_ptr + start, mask=count > 0, other=0).to(tl.int64)
    toks = _tile_tokens(order_ptr, start, count, BLOCK_M, DOT)
    phys0 = _first_rows(page_table_ptr, slot, PAGE, MAX_PAGES, BLOCK_R)
    wait_for_kernel_ahead(GDC)
    if (count > 0) & (rank > 0):
        n_ok = nn < c_end  # only ragged slices use it
        v_slice = v_ptr + sl * stride_vs
        if not (DOT and count > 1):  # without DOT the dot path is not compiled
            _expand_rows(v_slice, stride_vk, stride_vt, bt_ptr, stride_br, y_ptr, stride_yt, order_ptr, start,
                         count, tok0, phys0, page_table_ptr, slot, rank, scale, nn, n_ok, dy, SPLIT, SPLIT_P2, PAGE,
                         MAX_PAGES, BLOCK_R, RAGGED)  # fmt: skip
        else:
            _expand_dot(v_slice, stride_vk, stride_vt, bt_ptr, stride_br, y_ptr, stride_yt, toks, count, phys0,
                        page_table_ptr, slot, rank, scale, n0, c_end, dy, SPLIT, PAGE, MAX_PAGES, BLOCK_M, BLOCK_R,
                        BLOCK_N, DOT_N, RAGGED, PRECISION)  # fmt: skip


def decode_split(k_dim: int, block_k: int) -> int:
    """Number of v planes: one per BLOCK_K columns of the input."""
    return -(-k_dim // block_k)


def decode_shrink_launch(x, a, page_table, meta: LoRABatchMeta, page_rank: int, max_rank: int,
                         cfg: LaunchConfig, pools: int = 0):  # fmt: skip
    """As ``triton_ops.shrink_launch`` (same run-time arguments, ``shrink_args``): (FastLaunch or None when
    there is no work, v's shape [split, slices, T, max_rank]). One program per (tile slot, slice, BLOCK_K
    input columns)."""
    num_slices, _, k_dim = a.shape
    if pools:
        num_slices = pools
    split = decode_split(k_dim, cfg.block_k)
    shape = (split, num_slices, x.shape[0], max_rank)
    bound = meta.capacity if meta.capture else meta.host_num_tiles
    if not meta.capture and bound == 0:
        return None, shape
    constexprs = dict(
        SPLIT=split, PAGE=page_rank, MAX_PAGES=page_table.shape[1], BLOCK_M=meta.tile_m, BLOCK_R=16,
        BLOCK_K=cfg.block_k, PRECISION=_precision(x.dtype), X_ALIGN=align_hint(x.stride(0)),
        A_ALIGN=align_hint(math.gcd(a.stride(0), a.stride(1))), K_ALIGN=align_hint(k_dim), MULTI=bool(pools),
        DOT=cfg.decode_dot, DOT_K=min(128, cfg.block_k), GDC=cfg.pdl and pdl_available(x),
    )  # fmt: skip
    launch = FastLaunch(_shrink_decode_kernel, (bound, num_slices * split), constexprs,
                        num_warps=cfg.num_warps, num_stages=1, **pdl_option(constexprs["GDC"]))  # fmt: skip
    return launch, shape


def decode_expand_launch(y, bt, page_table, out_dims, slice_starts, meta: LoRABatchMeta, page_rank: int,
                         cfg: LaunchConfig, num_slices: int, split: int, pools: bool = False):  # fmt: skip
    """As ``triton_ops.expand_launch`` (same run-time arguments, ``expand_args``): FastLaunch, or None when
    there is no work. One program per (tile slot, BLOCK_N columns of one slice)."""
    shape = expand_geometry(y, bt, out_dims, slice_starts, meta, cfg.block_n, pools)
    if shape is None:
        return None
    bound, blocks, geo = shape
    constexprs = dict(
        NUM_SLICES=num_slices, SPLIT=split, SPLIT_P2=pow2_at_least(split, 1), PAGE=page_rank,
        MAX_PAGES=page_table.shape[1], BLOCK_M=meta.tile_m, BLOCK_R=16, BLOCK_N=cfg.block_n,
        PRECISION=_precision(y.dtype), Y_ALIGN=align_hint(y.stride(0)), B_ALIGN=align_hint(bt.stride(0)),
        MULTI=pools, DOT=cfg.decode_dot, DOT_N=min(64, cfg.block_n), GDC=cfg.pdl and pdl_available(y), **geo,
    )  # fmt: skip
    return FastLaunch(_expand_decode_kernel, (bound, blocks), constexprs, num_warps=cfg.num_warps,
                      num_stages=1, **pdl_option(constexprs["GDC"]))  # fmt: skip
