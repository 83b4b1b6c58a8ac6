"""One launch per projection for decode: split-K shrink, then expand by the same programs.

Grid (P, G): program (p, g) is member p of tile slot g's group. Member p first shrinks input columns
[p·K_PER, (p+1)·K_PER) of every slice into plane p of v (the shrink kernel's tile loop), then adds
C / P to the tile's counter in the metadata's ``sync`` buffer (release) and waits (acquire) until the
group's P additions are in. Every launch adds exactly C to the counter of each non-empty tile, so the
counters are multiples of C between launches and need no reset (they wrap modulo 2^32, a multiple of C).
Then member p expands column chunks p, p + P, ... of all slices, summing the P planes of v through L2.

One launch instead of two removes a kernel boundary and one dependent chain of loads (tile, tokens,
page table) per projection, and the expand of one tile starts as soon as that tile's shrink is done,
while other tiles still shrink.

Forward progress: the P members of a group are adjacent program ids (dim 0 varies fastest) and the GPU
starts thread blocks in order of their linear id, so only the last group started can be incomplete;
every group before it is complete and finishes without waiting on a later one, freeing room for the
rest. A group (P <= 64 programs) always fits on the device at once. Under Triton's interpreter, which runs
programs one at a time, the two phases are two launches of the same kernel (``PHASE``).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from loraplane.kernels.fast_launch import FastLaunch
from loraplane.kernels.launch_config import LaunchConfig, align_hint, pow2_at_least, slice_geometry
from loraplane.kernels.metadata import LoRABatchMeta
from loraplane.kernels.triton_helpers import _aligned, _pick, _pick_rt, _rows, _slice_of
from loraplane.kernels.triton_kernels import _shrink_tile
from loraplane.kernels.triton_ops import _precision

__all__ = ["FUSED_SYNC", "fused_args", "fused_launch", "fused_members"]

FUSED_SYNC = 64  # C: what one launch adds to a non-empty tile's counter; P must divide it
_SPIN_LIMIT = 1 << 22  # a bound on the wait, so that a broken assumption shows as wrong output, not a hang


@triton.jit
def _fused_expand_chunk(
    v_rows, stride_vk, bt_ptr, stride_br, y_rows, m_mask, slot, rank, scale, page_table_ptr, c0, c_end, dy,
    P: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, N_CHUNK: tl.constexpr, RAGGED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # As triton_kernels._expand_tile, with v summed over the P members' planes, read through L2 (.cg): the
    # planes were written by other programs of this launch, so L1 could hold stale lines.
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + offs_r
        r_mask = rr < rank
        phys = _rows(page_table_ptr, slot, rr, r_mask, PAGE, MAX_PAGES)
        vmask = m_mask[:, None] & r_mask[None, :]
        vs = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in tl.static_range(P):
            vs += tl.load(
                v_rows[:, None] + k * stride_vk + rr[None, :], mask=vmask, other=0.0, cache_modifier=".cg"
            )
        vs = (vs * scale).to(bt_ptr.dtype.element_ty)
        b_rows = bt_ptr + phys * stride_br  # [BR]
        if RAGGED:
            for n0 in range(c0, tl.minimum(c0 + N_CHUNK, c_end), BLOCK_N):
                nn = n0 + offs_n
                n_mask = nn < c_end
                bt = tl.load(b_rows[:, None] + nn[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
                y_ptrs = y_rows[:, None] + (nn + dy)[None, :]
                y_mask = m_mask[:, None] & n_mask[None, :]
                yt = tl.load(y_ptrs, mask=y_mask)
                acc = tl.dot(vs, bt, acc=yt.to(tl.float32), input_precision=PRECISION)
                tl.store(y_ptrs, acc.to(yt.dtype), mask=y_mask)
        else:
            for n0 in range(c0, c0 + N_CHUNK, BLOCK_N):
                nn = n0 + offs_n
                bt = tl.load(b_rows[:, None] + nn[None, :], mask=r_mask[:, None], other=0.0)
                y_ptrs = y_rows[:, None] + (nn + dy)[None, :]
                yt = tl.load(y_ptrs, mask=m_mask[:, None])
                acc = tl.dot(vs, bt, acc=yt.to(tl.float32), input_precision=PRECISION)
                tl.store(y_ptrs, acc.to(yt.dtype), mask=m_mask[:, None])


@triton.jit
def _fused_kernel(
    x_ptr, stride_xt, a_ptr, stride_as, stride_ar, v_ptr, stride_vk, stride_vs, stride_vt,
    bt_ptr, stride_br, y_ptr, stride_yt, tiles_ptr, order_ptr, pta_ptr, ptb_ptr, ranks_ptr, scales_ptr,
    sync_ptr, K, ao1, ao2, ao3, pa1, pa2, pa3, ro1, ro2, ro3, bo1, bo2, bo3, bs1, bs2, bs3, pb1, pb2, pb3,
    so1, so2, so3,
    NUM_SLICES: tl.constexpr, SLICES_P2: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, SMALL_R: tl.constexpr, SHRINK_R: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, K_PER: tl.constexpr, P: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    BLOCK_N: tl.constexpr, N_CHUNK: tl.constexpr, PRECISION: tl.constexpr, X_ALIGN: tl.constexpr,
    A_ALIGN: tl.constexpr, K_ALIGN: tl.constexpr, Y_ALIGN: tl.constexpr, B_ALIGN: tl.constexpr,
    RAGGED: tl.constexpr, CB1: tl.constexpr, CB2: tl.constexpr, CB3: tl.constexpr,
    OFF0: tl.constexpr, OFF1: tl.constexpr, OFF2: tl.constexpr, OFF3: tl.constexpr,
    END0: tl.constexpr, END1: tl.constexpr, END2: tl.constexpr, END3: tl.constexpr,
    DY0: tl.constexpr, DY1: tl.constexpr, DY2: tl.constexpr, DY3: tl.constexpr,
    MULTI: tl.constexpr, PHASE: tl.constexpr, SYNC: tl.constexpr, SPIN_LIMIT: tl.constexpr,
):  # fmt: skip
    # PHASE 0: shrink, wait for the group, expand (GPU); 1: shrink only; 2: expand only (interpreter).
    # MULTI: slice s from its own pool (one slot numbering), addressed as element offsets from pool 0's
    # tensors: A (ao), A's page table (pa), ranks (ro), B^T (bo, row stride bs), B's page table (pb),
    # scales (so).
    stride_xt = _aligned(stride_xt, X_ALIGN)
    stride_as = _aligned(stride_as, A_ALIGN)
    stride_ar = _aligned(stride_ar, A_ALIGN)
    stride_yt = _aligned(stride_yt, Y_ALIGN)
    K = _aligned(K, K_ALIGN)
    p = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    if count > 0:  # the whole group skips an empty tile slot, and leaves its counter alone
        rank = tl.load(ranks_ptr + slot)
        rk0, rk1, rk2, rk3 = rank, rank, rank, rank
        if MULTI:  # an adapter without a pool's module has rank 0 there: no work
            rk1, rk2, rk3 = rank * 0, rank * 0, rank * 0
            if NUM_SLICES > 1:
                rk1 = tl.load(ranks_ptr + ro1 + slot)
            if NUM_SLICES > 2:
                rk2 = tl.load(ranks_ptr + ro2 + slot)
            if NUM_SLICES > 3:
                rk3 = tl.load(ranks_ptr + ro3 + slot)
            rank = tl.maximum(tl.maximum(rk0, rk1), tl.maximum(rk2, rk3))
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        tok = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        if PHASE != 2:
            x_rows = x_ptr + tok * stride_xt  # [BM]
            v_rows = v_ptr + p * stride_vk + tok * stride_vt  # [BM]
            if SHRINK_R > SMALL_R and rank <= SMALL_R:
                _shrink_tile(
                    x_rows, a_ptr, stride_as, stride_ar, v_rows, stride_vs, m_mask, slot, rank, pta_ptr,
                    p * K_PER, K, ao1, ao2, ao3, pa1, pa2, pa3, rk0, rk1, rk2, rk3, NUM_SLICES, SLICES_P2,
                    PAGE, MAX_PAGES, BLOCK_M, SMALL_R, BLOCK_K, K_PER, PRECISION, MULTI,
                )  # fmt: skip
            else:
                _shrink_tile(
                    x_rows, a_ptr, stride_as, stride_ar, v_rows, stride_vs, m_mask, slot, rank, pta_ptr,
                    p * K_PER, K, ao1, ao2, ao3, pa1, pa2, pa3, rk0, rk1, rk2, rk3, NUM_SLICES, SLICES_P2,
                    PAGE, MAX_PAGES, BLOCK_M, SHRINK_R, BLOCK_K, K_PER, PRECISION, MULTI,
                )  # fmt: skip
        if PHASE == 0:
            tl.debug_barrier()  # every thread's v stores precede the release below
            old = tl.atomic_add(sync_ptr + tile, SYNC // P, sem="acq_rel", scope="gpu")
            base = old & (-SYNC)
            cur = old + SYNC // P
            spins = 0
            while ((cur & (-SYNC)) == base) & (spins < SPIN_LIMIT):
                cur = tl.atomic_add(sync_ptr + tile, 0, sem="acquire", scope="gpu")
                spins += 1
        if PHASE != 1:
            y_rows = y_ptr + tok * stride_yt  # [BM]
            for c_base in range(0, NUM_CHUNKS, P):  # member p takes chunks p, p + P, ...
                c = c_base + p
                if c < NUM_CHUNKS:
                    sl = _slice_of(c, NUM_SLICES, CB1, CB2, CB3)
                    c0 = c * N_CHUNK + _pick(sl, OFF0, OFF1, OFF2, OFF3)
                    c_end = _pick(sl, END0, END1, END2, END3)
                    dy = _pick(sl, DY0, DY1, DY2, DY3)
                    bt = bt_ptr
                    sbr = stride_br
                    ptb = ptb_ptr
                    rk = rank
                    sc_ptr = scales_ptr
                    if MULTI:
                        bt += _pick_rt(sl, 0, bo1, bo2, bo3)
                        sbr = _pick_rt(sl, stride_br, bs1, bs2, bs3)
                        ptb += _pick_rt(sl, 0, pb1, pb2, pb3)
                        rk = _pick_rt(sl, rk0, rk1, rk2, rk3)
                        sc_ptr += _pick_rt(sl, 0, so1, so2, so3)
                    sbr = _aligned(sbr, B_ALIGN)
                    scale = tl.load(sc_ptr + slot)
                    v_rows = v_ptr + sl * stride_vs + tok * stride_vt  # [BM]
                    if BLOCK_R > SMALL_R and rk <= SMALL_R:
                        _fused_expand_chunk(
                            v_rows, stride_vk, bt, sbr, y_rows, m_mask, slot, rk, scale, ptb, c0, c_end, dy, P,
                            PAGE, MAX_PAGES, BLOCK_M, SMALL_R, BLOCK_N, N_CHUNK, RAGGED, PRECISION,
                        )  # fmt: skip
                    else:
                        _fused_expand_chunk(
                            v_rows, stride_vk, bt, sbr, y_rows, m_mask, slot, rk, scale, ptb, c0, c_end, dy, P,
                            PAGE, MAX_PAGES, BLOCK_M, BLOCK_R, BLOCK_N, N_CHUNK, RAGGED, PRECISION,
                        )  # fmt: skip


def fused_members(cfg: LaunchConfig, num_chunks: int) -> int:
    """P, the programs per tile: at least the split-K of shrink, and up to one per column chunk (so the
    expand keeps as many programs as the two-launch form had chunks), at most 16."""
    p = cfg.split_k
    while p < 16 and p * 2 <= num_chunks:
        p *= 2
    return p


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_launch(x, a, y, bt, page_table, meta: LoRABatchMeta, page_rank: int, max_rank: int, cfg: LaunchConfig,
                 out_dims, slice_starts, pools: int = 0):  # fmt: skip
    """The fused launch(es) of one projection: ([FastLaunch, ...] (one; two phases under the interpreter)
    or [] when there is no work, v's shape). ``pools`` > 0: that many single-slice pools (their B^T
    columns start at 0). Checks the geometry as expand_launch does."""
    num_slices, _, k_dim = a.shape
    if pools:
        num_slices = pools
    if y.stride(1) != 1 or bt.stride(1) != 1:
        raise ValueError("y and bt must be contiguous along their last dimension")
    if (bt.shape[1] != (out_dims[0] if pools else sum(out_dims))) or y.shape[1] < max(
        c + w for c, w in zip(slice_starts, out_dims, strict=True)
    ):
        raise ValueError(
            f"bt [{bt.shape[1]} cols] and y [{y.shape[1]} cols] do not hold slices {out_dims} at {slice_starts}"
        )
    packed = (0,) * len(out_dims) if pools else None
    chunks, geo = slice_geometry(tuple(out_dims), tuple(slice_starts), cfg.n_chunk, packed)
    p = fused_members(cfg, chunks)
    shape = (p, num_slices, x.shape[0], max_rank)
    bound = meta.capacity if meta.capture else meta.host_num_tiles
    if not meta.capture and bound == 0:
        return [], shape
    k_per = -(-k_dim // p)
    k_per = -(-k_per // cfg.block_k) * cfg.block_k
    constexprs = dict(
        NUM_SLICES=num_slices, SLICES_P2=pow2_at_least(num_slices, 1), PAGE=page_rank,
        MAX_PAGES=page_table.shape[1], BLOCK_M=meta.tile_m, SMALL_R=min(16, cfg.block_r),
        SHRINK_R=cfg.shrink_block_r, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, K_PER=k_per, P=p,
        NUM_CHUNKS=chunks, BLOCK_N=cfg.block_n, N_CHUNK=cfg.n_chunk, PRECISION=_precision(x.dtype),
        X_ALIGN=align_hint(x.stride(0)), A_ALIGN=align_hint(math.gcd(a.stride(0), a.stride(1))),
        K_ALIGN=align_hint(k_dim), Y_ALIGN=align_hint(y.stride(0)), B_ALIGN=align_hint(bt.stride(0)), **geo,
        MULTI=bool(pools), SYNC=FUSED_SYNC, SPIN_LIMIT=_SPIN_LIMIT,
    )  # fmt: skip
    phases = (1, 2) if _interpreted() else (0,)
    launches = [
        FastLaunch(
            _fused_kernel,
            (p, bound),
            {**constexprs, "PHASE": ph},
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        for ph in phases
    ]
    return launches, shape


def fused_args(
    x, a, v, y, bt, pt_a, pt_b, ranks, scales, meta: LoRABatchMeta, offsets: tuple = (0,) * 21
) -> tuple:
    """The fused kernel's run-time arguments, in order. ``offsets``: element offsets of pools 1..3 from
    pool 0's tensors, three each: A, A's page table, ranks, B^T, B^T row strides, B's page table, scales."""
    sync = meta.sync_counters(x.device)
    return (x, x.stride(0), a, a.stride(0), a.stride(1), v, v.stride(0), v.stride(1), v.stride(2),
            bt, bt.stride(0), y, y.stride(0), meta.tiles, meta.token_order, pt_a, pt_b, ranks, scales,
            sync, a.shape[2], *offsets)  # fmt: skip


def fused_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    page_table: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out_dims: tuple[int, ...],
    slice_starts: tuple[int, ...],
    meta: LoRABatchMeta,
    page_rank: int,
    max_rank: int,
    cfg: LaunchConfig,
) -> torch.Tensor:
    """Semantics: as ``lora_apply`` (reference.shrink_torch then expand_torch) for one packed module: for
    every token t with an adapter a and every slice s, y[t, c_s : c_s + w_s] += scale_a · (x[t] @
    A_{a,s}^T) @ B_{a,s}^T; rows without an adapter and columns outside the slices unchanged. In place.

    x: [T, K]; a: [S, rows, K]; y: [T, >= every slice's end]; bt: [rows, sum(out_dims)] (packed).
    """
    launches, shape = fused_launch(
        x, a, y, bt, page_table, meta, page_rank, max_rank, cfg, out_dims, slice_starts
    )
    v = meta.scratch_f32(shape, x.device)
    for launch in launches:
        launch(*fused_args(x, a, v, y, bt, page_table, page_table, ranks, scales, meta))
    return y
