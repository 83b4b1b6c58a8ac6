"""The decode expand's device functions (``triton_decode._expand_decode_kernel`` calls them).

Per tile of one adapter: ``_expand_rows`` walks its tokens one at a time on the vector path (the v planes
summed, then a [BLOCK_R, BLOCK_N] block of B^T per rank chunk, multiplied and reduced in float32);
``_expand_dot`` takes them together with ``tl.dot``, so the adapter's B is read once for the whole tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplane.kernels.triton_helpers import _rows


@triton.jit
def _v_sum(v_ptrs, stride_vk, mask, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr):
    """The SPLIT partial planes of v at ``v_ptrs`` [BR] (plane 0), summed in float32: one [planes, BR] load
    spread over the threads and a reduction across them (a [BR] vector is held by many threads at once, so
    loading it plane by plane repeats every plane's load in each of them)."""
    planes = tl.arange(0, SPLIT_P2)
    ptrs = v_ptrs[None, :] + planes[:, None] * stride_vk
    return tl.sum(tl.load(ptrs, mask=(planes < SPLIT)[:, None] & mask[None, :], other=0.0), axis=0)


@triton.jit
def _v_sum2(v_ptrs, stride_vk, mask, SPLIT: tl.constexpr):
    """As ``_v_sum`` for [BM, BR] pointers, plane by plane: a [BM, BR] plane is already spread over the
    threads (two values each), where a [planes, BM, BR] block would not be."""
    vs = tl.load(v_ptrs, mask=mask, other=0.0)
    for k in tl.static_range(1, SPLIT):
        vs += tl.load(v_ptrs + k * stride_vk, mask=mask, other=0.0)
    return vs


@triton.jit
def _b_block(b_blk, r_mask, n_ok, RAGGED: tl.constexpr):
    """[BR, BN] of B^T; only a ragged slice masks columns (unmasked columns load as wide vectors)."""
    if RAGGED:
        bt = tl.load(b_blk, mask=r_mask[:, None] & n_ok[None, :], other=0.0)
    else:
        bt = tl.load(b_blk, mask=r_mask[:, None], other=0.0)
    return bt


@triton.jit
def _y_load(y_ptrs, mask, RAGGED: tl.constexpr):
    """y at ``y_ptrs``; only a ragged slice masks columns (``mask``)."""
    if RAGGED:
        yv = tl.load(y_ptrs, mask=mask)
    else:
        yv = tl.load(y_ptrs)
    return yv


@triton.jit
def _expand_token(v_slice, stride_vk, stride_vt, tok, bt0, bt_ptr, stride_br, y_ptr, stride_yt, pt, slot, rank,
                  scale, nn, n_ok, dy, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, PAGE: tl.constexpr,
                  MAX_PAGES: tl.constexpr, BLOCK_R: tl.constexpr, RAGGED: tl.constexpr):  # fmt: skip
    # y[tok, nn] += scale * sum_r v[tok, r] * B^T[r, nn], in float32; bt0: B^T's first rank chunk. y is read
    # in the same round as v, not after the sum.
    offs_r = tl.arange(0, BLOCK_R)
    y_ptrs = y_ptr + tok * stride_yt + nn + dy
    yv = _y_load(y_ptrs, n_ok, RAGGED)
    vs = _v_sum(v_slice + tok * stride_vt + offs_r, stride_vk, offs_r < rank, SPLIT, SPLIT_P2)  # [BR]
    acc = tl.sum(bt0.to(tl.float32) * vs[:, None], axis=0)  # [BN]
    for r0 in range(BLOCK_R, rank, BLOCK_R):  # ranks above BLOCK_R
        rr = r0 + offs_r
        r_mask = rr < rank
        phys = _rows(pt, slot, rr, r_mask, PAGE, MAX_PAGES)
        vs = _v_sum(v_slice + tok * stride_vt + rr, stride_vk, r_mask, SPLIT, SPLIT_P2)
        bt = _b_block(bt_ptr + phys[:, None] * stride_br + nn[None, :], r_mask, n_ok, RAGGED)  # [BR, BN]
        acc += tl.sum(bt.to(tl.float32) * vs[:, None], axis=0)
    out = (yv.to(tl.float32) + acc * scale).to(yv.dtype)
    if RAGGED:
        tl.store(y_ptrs, out, mask=n_ok)
    else:
        tl.store(y_ptrs, out)


@triton.jit
def _expand_rows(v_slice, stride_vk, stride_vt, bt_ptr, stride_br, y_ptr, stride_yt, order_ptr, start, count, tok0,
                 phys0, pt, slot, rank, scale, nn, n_ok, dy, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
                 PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, BLOCK_R: tl.constexpr,
                 RAGGED: tl.constexpr):  # fmt: skip
    # A token at a time, in float32. B^T's first rank chunk is read once for the tile's tokens, in the same
    # round of loads as the first token's v and y.
    bt0 = _b_block(bt_ptr + phys0[:, None] * stride_br + nn[None, :], tl.arange(0, BLOCK_R) < rank, n_ok,
                   RAGGED)  # [BR, BN]  # fmt: skip
    _expand_token(v_slice, stride_vk, stride_vt, tok0, bt0, bt_ptr, stride_br, y_ptr, stride_yt, pt, slot, rank,
                  scale, nn, n_ok, dy, SPLIT, SPLIT_P2, PAGE, MAX_PAGES, BLOCK_R, RAGGED)  # fmt: skip
    for m in range(1, count):
        tok = tl.load(order_ptr + start + m).to(tl.int64)
        # B^T again (a cache hit): holding the first chunk across the loop would double the registers
        bt = _b_block(
            bt_ptr + phys0[:, None] * stride_br + nn[None, :], tl.arange(0, BLOCK_R) < rank, n_ok, RAGGED
        )
        _expand_token(v_slice, stride_vk, stride_vt, tok, bt, bt_ptr, stride_br, y_ptr, stride_yt, pt, slot, rank,
                      scale, nn, n_ok, dy, SPLIT, SPLIT_P2, PAGE, MAX_PAGES, BLOCK_R, RAGGED)  # fmt: skip


@triton.jit
def _expand_dot(v_slice, stride_vk, stride_vt, bt_ptr, stride_br, y_ptr, stride_yt, toks, count, phys0, pt, slot,
                rank, scale, n0, c_end, dy, SPLIT: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_N: tl.constexpr,
                RAGGED: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    # The tile's tokens together: each block of B^T is read once for all of them. Columns [n0, n0 + BLOCK_N)
    # in DOT_N-column pieces (small MMA operands and accumulator); the first rank chunk's v is summed once
    # for all pieces.
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = tl.arange(0, BLOCK_M) < count
    vs0 = _v_sum2(v_slice + toks[:, None] * stride_vt + offs_r[None, :], stride_vk,
                  m_mask[:, None] & (offs_r < rank)[None, :], SPLIT)  # [BM, BR]  # fmt: skip
    vs0 = (vs0 * scale).to(bt_ptr.dtype.element_ty)  # the scale rides on v, as in _expand_tile
    if rank <= BLOCK_R:
        # One rank chunk: the pieces unrolled, so that their loads of B^T and y are in flight at once.
        for p0 in tl.static_range(0, BLOCK_N, DOT_N):
            _expand_piece(vs0, v_slice, stride_vk, stride_vt, bt_ptr, stride_br, y_ptr, stride_yt, toks, m_mask,
                          phys0, pt, slot, rank, scale, n0 + p0, c_end, dy, SPLIT, PAGE, MAX_PAGES, BLOCK_R, DOT_N,
                          RAGGED, PRECISION, False)  # fmt: skip
    else:
        # Each piece loops over the rank chunks, which orders its loads anyway; unrolling these pieces too
        # multiplied the code (each chunk sums SPLIT v planes) and with it the compile time: over a minute
        # for a 28-plane projection at 1024 columns, against seconds.
        for p0 in range(0, BLOCK_N, DOT_N):
            _expand_piece(vs0, v_slice, stride_vk, stride_vt, bt_ptr, stride_br, y_ptr, stride_yt, toks, m_mask,
                          phys0, pt, slot, rank, scale, n0 + p0, c_end, dy, SPLIT, PAGE, MAX_PAGES, BLOCK_R, DOT_N,
                          RAGGED, PRECISION, True)  # fmt: skip


@triton.jit
def _expand_piece(vs0, v_slice, stride_vk, stride_vt, bt_ptr, stride_br, y_ptr, stride_yt, toks, m_mask, phys0, pt,
                  slot, rank, scale, c0, c_end, dy, SPLIT: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
                  BLOCK_R: tl.constexpr, DOT_N: tl.constexpr, RAGGED: tl.constexpr, PRECISION: tl.constexpr,
                  HIGH: tl.constexpr):  # fmt: skip
    # y[toks, c0 : c0 + DOT_N] += v @ B^T over the rank chunks; vs0: the first chunk's v, scaled. HIGH: the
    # rank may be above BLOCK_R (else only the first chunk is compiled).
    offs_r = tl.arange(0, BLOCK_R)
    nn = c0 + tl.arange(0, DOT_N)  # [DN]
    n_ok = nn < c_end
    y_ptrs = y_ptr + toks[:, None] * stride_yt + (nn + dy)[None, :]
    if RAGGED:
        y_mask = m_mask[:, None] & n_ok[None, :]
    else:
        y_mask = m_mask[:, None]
    yt = tl.load(y_ptrs, mask=y_mask)
    bt = _b_block(bt_ptr + phys0[:, None] * stride_br + nn[None, :], offs_r < rank, n_ok, RAGGED)  # [BR, DN]
    acc = tl.dot(vs0, bt, out_dtype=tl.float32, input_precision=PRECISION)  # [BM, DN]
    if HIGH:
        for r0 in range(BLOCK_R, rank, BLOCK_R):  # ranks above BLOCK_R
            rr = r0 + offs_r
            r_mask = rr < rank
            phys = _rows(pt, slot, rr, r_mask, PAGE, MAX_PAGES)
            vs = _v_sum2(v_slice + toks[:, None] * stride_vt + rr[None, :], stride_vk,
                         m_mask[:, None] & r_mask[None, :], SPLIT)  # [BM, BR]  # fmt: skip
            vs = (vs * scale).to(bt_ptr.dtype.element_ty)
            bt = _b_block(bt_ptr + phys[:, None] * stride_br + nn[None, :], r_mask, n_ok, RAGGED)  # [BR, DN]
            acc = tl.dot(vs, bt, acc=acc, input_precision=PRECISION)
    tl.store(y_ptrs, (yt.to(tl.float32) + acc).to(yt.dtype), mask=y_mask)
