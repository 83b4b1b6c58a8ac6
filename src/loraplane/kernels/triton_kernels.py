"""The Triton multi-LoRA shrink and expand kernels over a paged pool (see pool.py for the layout).

Two launches per projection, no zero-fill: shrink writes every v entry that expand reads (split-K
partials go to separate planes, summed by expand, so no atomics), and expand adds into y (or, STORE,
writes the delta into a y that the base GEMM then adds itself to: the expand then never reads y).
Both grids are sized to useful work: dim 0 strides over the step's tiles (up to the capacity under a
CUDA graph; tiles past the step's last have count 0 and are skipped), never over pool slots, so idle
resident adapters cost nothing and rows without an adapter are in no tile.
Every rank loop runs to the tile's own rank, in chunks of BLOCK_R rows gathered through the page table,
so a rank-8 adapter moves an eighth of a rank-64 one.
Any in_dim, any slice width and any slice start in y: K tiles are masked in shrink; expand's slice
geometry is compile-time, and only modules whose widths some column chunk does not divide compile the
masked (RAGGED) column loop, so aligned modules run the unmasked loop with provably aligned columns.
Their launch shapes, argument lists and entry points are in triton_ops.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplane.kernels.triton_helpers import _aligned, _chunk_of, _pick_rt, _pool_of_slice, _rows


@triton.jit
def _shrink_tile(
    x_rows, a_ptr, stride_as, stride_ar, v_rows, stride_vs, m_mask, slot, rank, page_table_ptr, k_begin, K,
    ao1, ao2, ao3, po1, po2, po3, rk0, rk1, rk2, rk3,
    NUM_SLICES: tl.constexpr, SLICES_P2: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, MULTI: tl.constexpr,
):  # fmt: skip
    # All slices' rank-rows side by side: column j is slice j // BLOCK_R, rank-row r0 + j % BLOCK_R.
    # MULTI: slice s lives in its own pool: A at element offset ao_s from a_ptr, its page table at
    # po_s from page_table_ptr, its rank rk_s (rank = the largest; ao_0 = po_0 = 0).
    offs_j = tl.arange(0, SLICES_P2 * BLOCK_R)
    j_slice = offs_j // BLOCK_R
    j_rank = offs_j % BLOCK_R
    offs_k = tl.arange(0, BLOCK_K)
    if MULTI:
        a_off = _pick_rt(j_slice, 0, ao1, ao2, ao3).to(tl.int64)
        pt = page_table_ptr + _pick_rt(j_slice, 0, po1, po2, po3)
        rank_j = _pick_rt(j_slice, rk0, rk1, rk2, rk3)
    else:
        a_off = j_slice.to(tl.int64) * stride_as
        pt = page_table_ptr
        rank_j = rank
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + j_rank
        j_mask = (j_slice < NUM_SLICES) & (rr < rank_j)
        phys = _rows(pt, slot, rr, j_mask, PAGE, MAX_PAGES)
        a_rows = a_ptr + a_off + phys * stride_ar  # [J]
        acc = tl.zeros((BLOCK_M, SLICES_P2 * BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            kk = k_begin + k0 + offs_k
            k_mask = kk < K
            xt = tl.load(x_rows[:, None] + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_rows[:, None] + kk[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(xt, tl.trans(at), input_precision=PRECISION)
        v_ptrs = v_rows[:, None] + j_slice[None, :] * stride_vs + rr[None, :]
        tl.store(v_ptrs, acc, mask=m_mask[:, None] & j_mask[None, :])


@triton.jit(do_not_specialize=["tile_bound"])  # a step's tile count: no compile per value class
def _shrink_kernel(
    x_ptr, stride_xt, a_ptr, stride_as, stride_ar, v_ptr, stride_vk, stride_vs, stride_vt,
    tiles_ptr, tile_bound, order_ptr, page_table_ptr, ranks_ptr, K,
    ao1, ao2, ao3, po1, po2, po3, ro1, ro2, ro3,
    NUM_SLICES: tl.constexpr, SLICES_P2: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, SMALL_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr, PRECISION: tl.constexpr, X_ALIGN: tl.constexpr, A_ALIGN: tl.constexpr,
    K_ALIGN: tl.constexpr, MULTI: tl.constexpr,
):  # fmt: skip
    # program (g, k): tiles g, g+G, ...; K range [k*K_PER_SPLIT, (k+1)*K_PER_SPLIT) -> v plane k.
    # Tiles of rank <= SMALL_R take a narrow copy of the loop: work follows each tile's own rank.
    # MULTI: each slice from its own pool (one slot numbering): offsets ao_s (A, elements), po_s (page
    # table) and ro_s (ranks) from the slice-0 pool's tensors; unused with MULTI off.
    stride_xt = _aligned(stride_xt, X_ALIGN)
    stride_as = _aligned(stride_as, A_ALIGN)
    stride_ar = _aligned(stride_ar, A_ALIGN)
    K = _aligned(K, K_ALIGN)  # the K mask's constancy: masked loads stay vectorized
    pid_g = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_g = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    k_begin = pid_k * K_PER_SPLIT
    for tile in range(pid_g, tile_bound, num_g):
        slot = tl.load(tiles_ptr + tile * 3)
        start = tl.load(tiles_ptr + tile * 3 + 1)
        count = tl.load(tiles_ptr + tile * 3 + 2)
        if count > 0:  # tiles past the step's last are zeroed by the builder
            rank = tl.load(ranks_ptr + slot)
            rk0, rk1, rk2, rk3 = rank, rank, rank, rank
            if MULTI:  # a slot an adapter does not have in a pool has rank 0 there: no work
                rk1, rk2, rk3 = rank * 0, rank * 0, rank * 0
                if NUM_SLICES > 1:
                    rk1 = tl.load(ranks_ptr + ro1 + slot)
                if NUM_SLICES > 2:
                    rk2 = tl.load(ranks_ptr + ro2 + slot)
                if NUM_SLICES > 3:
                    rk3 = tl.load(ranks_ptr + ro3 + slot)
                rank = tl.maximum(tl.maximum(rk0, rk1), tl.maximum(rk2, rk3))
            m_mask = offs_m < count
            tok = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
            x_rows = x_ptr + tok * stride_xt  # [BM]
            v_rows = v_ptr + pid_k * stride_vk + tok * stride_vt  # [BM]
            # The constexpr test short-circuits: with BLOCK_R == SMALL_R only the wide copy is compiled.
            if BLOCK_R > SMALL_R and rank <= SMALL_R:
                _shrink_tile(
                    x_rows, a_ptr, stride_as, stride_ar, v_rows, stride_vs, m_mask, slot, rank, page_table_ptr,
                    k_begin, K, ao1, ao2, ao3, po1, po2, po3, rk0, rk1, rk2, rk3, NUM_SLICES, SLICES_P2, PAGE,
                    MAX_PAGES, BLOCK_M, SMALL_R, BLOCK_K, K_PER_SPLIT, PRECISION, MULTI,
                )  # fmt: skip
            else:
                _shrink_tile(
                    x_rows, a_ptr, stride_as, stride_ar, v_rows, stride_vs, m_mask, slot, rank, page_table_ptr,
                    k_begin, K, ao1, ao2, ao3, po1, po2, po3, rk0, rk1, rk2, rk3, NUM_SLICES, SLICES_P2, PAGE,
                    MAX_PAGES, BLOCK_M, BLOCK_R, BLOCK_K, K_PER_SPLIT, PRECISION, MULTI,
                )  # fmt: skip


@triton.jit
def _expand_tile(
    v_rows, stride_vk, x_rows, a_rows_base, stride_ar, K, bt_ptr, stride_br, y_rows, m_mask, slot, rank, scale,
    page_table_ptr, c0, c_end, dy,
    SPLIT: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
    FUSED: tl.constexpr, RAGGED: tl.constexpr, PRECISION: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    # Columns c of this chunk are packed B^T columns; y column = c + dy. RAGGED: the chunk may run past
    # its slice's end c_end, so the loop stops there and the last column tile is masked. STORE: y holds
    # nothing yet (the base GEMM adds itself on top afterwards), so the first rank chunk writes the delta
    # without reading y (a masked-off load moves no bytes); later chunks of a rank above BLOCK_R add to it.
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + offs_r
        r_mask = rr < rank
        phys = _rows(page_table_ptr, slot, rr, r_mask, PAGE, MAX_PAGES)
        if FUSED:
            a_rows = a_rows_base + phys * stride_ar
            vs = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                k_mask = kk < K
                xt = tl.load(x_rows[:, None] + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                at = tl.load(a_rows[:, None] + kk[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                vs += tl.dot(xt, tl.trans(at), input_precision=PRECISION)
        else:
            vmask = m_mask[:, None] & r_mask[None, :]
            vs = tl.load(v_rows[:, None] + rr[None, :], mask=vmask, other=0.0)
            for k in tl.static_range(1, SPLIT):
                vs += tl.load(v_rows[:, None] + k * stride_vk + rr[None, :], mask=vmask, other=0.0)
        # The scale rides on v: one multiply per (token, rank) instead of per output.
        vs = (vs * scale).to(bt_ptr.dtype.element_ty)
        b_rows = bt_ptr + phys * stride_br  # [BR]
        if RAGGED:
            for n0 in range(c0, tl.minimum(c0 + N_CHUNK, c_end), BLOCK_N):
                nn = n0 + offs_n
                n_mask = nn < c_end
                bt = tl.load(b_rows[:, None] + nn[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
                y_ptrs = y_rows[:, None] + (nn + dy)[None, :]
                y_mask = m_mask[:, None] & n_mask[None, :]
                if STORE:
                    yt = tl.load(y_ptrs, mask=y_mask & (r0 > 0), other=0.0)
                else:
                    yt = tl.load(y_ptrs, mask=y_mask)
                acc = tl.dot(vs, bt, acc=yt.to(tl.float32), input_precision=PRECISION)
                tl.store(y_ptrs, acc.to(yt.dtype), mask=y_mask)
        else:
            for n0 in range(c0, c0 + N_CHUNK, BLOCK_N):
                nn = n0 + offs_n
                bt = tl.load(b_rows[:, None] + nn[None, :], mask=r_mask[:, None], other=0.0)
                y_ptrs = y_rows[:, None] + (nn + dy)[None, :]
                if STORE:
                    yt = tl.load(y_ptrs, mask=m_mask[:, None] & (r0 > 0), other=0.0)
                else:
                    yt = tl.load(y_ptrs, mask=m_mask[:, None])
                acc = tl.dot(vs, bt, acc=yt.to(tl.float32), input_precision=PRECISION)
                tl.store(y_ptrs, acc.to(yt.dtype), mask=m_mask[:, None])


@triton.jit(do_not_specialize=["tile_bound"])  # a step's tile count: no compile per value class
def _expand_kernel(
    v_ptr, stride_vk, stride_vs, stride_vt, x_ptr, stride_xt, a_ptr, stride_as, stride_ar, K,
    bt_ptr, stride_br, y_ptr, stride_yt, tiles_ptr, tile_bound, order_ptr, page_table_ptr, ranks_ptr,
    scales_ptr, bo1, bo2, bo3, bs1, bs2, bs3, po1, po2, po3, ro1, ro2, ro3, so1, so2, so3,
    NUM_SLICES: tl.constexpr, SPLIT: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, SMALL_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    N_CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, FUSED: tl.constexpr, PRECISION: tl.constexpr,
    Y_ALIGN: tl.constexpr, B_ALIGN: tl.constexpr,
    RAGGED: tl.constexpr, CB1: tl.constexpr, CB2: tl.constexpr, CB3: tl.constexpr,
    OFF0: tl.constexpr, OFF1: tl.constexpr, OFF2: tl.constexpr, OFF3: tl.constexpr,
    END0: tl.constexpr, END1: tl.constexpr, END2: tl.constexpr, END3: tl.constexpr,
    DY0: tl.constexpr, DY1: tl.constexpr, DY2: tl.constexpr, DY3: tl.constexpr, MULTI: tl.constexpr,
    STORE: tl.constexpr,
):  # fmt: skip
    # program (g, c): tiles g, g+G, ...; column chunk c of one slice. Slice s owns chunks [CB_s, CB_s+1);
    # chunk c covers packed B^T columns c*N_CHUNK + OFF_s onwards, up to END_s, and y columns DY_s further
    # (compile-time: launch_config.slice_geometry). v is loaded (or, FUSED, computed from x and A: no
    # shrink launch) once per tile and rank chunk, then the column loop streams B^T and y, pipelined by
    # the compiler. Tiles of rank <= SMALL_R use narrow tiles. MULTI: slice s from its own pool (one slot
    # numbering): B^T at element offset bo_s from bt_ptr with row stride bs_s, page table, ranks and
    # scales at po_s, ro_s, so_s from the slice-0 pool's; each B^T's columns start at 0 (OFF_s, END_s).
    stride_yt = _aligned(stride_yt, Y_ALIGN)
    pid_g = tl.program_id(0)
    pid_c = tl.program_id(1)
    num_g = tl.num_programs(0)
    sl, c0, c_end, dy = _chunk_of(pid_c, N_CHUNK, NUM_SLICES, CB1, CB2, CB3, OFF0, OFF1, OFF2, OFF3, END0, END1, END2,
                                  END3, DY0, DY1, DY2, DY3)  # fmt: skip
    if MULTI:
        bt_ptr, stride_br, page_table_ptr, ranks_ptr, scales_ptr = _pool_of_slice(
            sl, bt_ptr, stride_br, page_table_ptr, ranks_ptr, scales_ptr,
            bo1, bo2, bo3, bs1, bs2, bs3, po1, po2, po3, ro1, ro2, ro3, so1, so2, so3,
        )  # fmt: skip
    stride_br = _aligned(stride_br, B_ALIGN)
    offs_m = tl.arange(0, BLOCK_M)
    for tile in range(pid_g, tile_bound, num_g):
        slot = tl.load(tiles_ptr + tile * 3)
        start = tl.load(tiles_ptr + tile * 3 + 1)
        count = tl.load(tiles_ptr + tile * 3 + 2)
        if count > 0:  # tiles past the step's last are zeroed by the builder
            rank = tl.load(ranks_ptr + slot)
            scale = tl.load(scales_ptr + slot)
            m_mask = offs_m < count
            tok = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
            y_rows = y_ptr + tok * stride_yt  # [BM]
            v_rows = v_ptr + sl * stride_vs + tok * stride_vt  # [BM]
            x_rows = x_ptr + tok * stride_xt  # [BM]
            a_rows_base = a_ptr + sl * stride_as
            if BLOCK_R > SMALL_R and rank <= SMALL_R:  # constexpr short-circuit, as in _shrink_kernel
                _expand_tile(
                    v_rows, stride_vk, x_rows, a_rows_base, stride_ar, K, bt_ptr, stride_br, y_rows, m_mask,
                    slot, rank, scale, page_table_ptr, c0, c_end, dy, SPLIT, PAGE, MAX_PAGES, BLOCK_M, SMALL_R,
                    BLOCK_N, N_CHUNK, BLOCK_K, FUSED, RAGGED, PRECISION, STORE,
                )  # fmt: skip
            else:
                _expand_tile(
                    v_rows, stride_vk, x_rows, a_rows_base, stride_ar, K, bt_ptr, stride_br, y_rows, m_mask,
                    slot, rank, scale, page_table_ptr, c0, c_end, dy, SPLIT, PAGE, MAX_PAGES, BLOCK_M, BLOCK_R,
                    BLOCK_N, N_CHUNK, BLOCK_K, FUSED, RAGGED, PRECISION, STORE,
                )  # fmt: skip
