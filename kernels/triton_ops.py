"""Triton multi-LoRA shrink and expand over a paged pool (see pool.py for the layout).

Two launches per projection, no zero-fill: shrink writes every v entry that expand reads (split-K
partials go to separate planes, summed by expand, so no atomics), and expand adds into y.
Both grids are sized to useful work: dim 0 strides over the step's tiles (``meta.num_tiles``, read on
the device), never over pool slots, so idle resident adapters cost nothing and rows without an adapter
are in no tile. Every rank loop runs to the tile's own rank, in chunks of BLOCK_R rows gathered through
the page table, so a rank-8 adapter moves an eighth of a rank-64 one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .metadata import LoRABatchMeta

__all__ = ["LaunchConfig", "expand_triton", "pick_config", "shrink_triton"]


@triton.jit
def _rows(page_table_ptr, slot, j, mask, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr):
    """Physical row (int64) of rank-rows ``j`` of ``slot``."""
    page = tl.load(page_table_ptr + slot * MAX_PAGES + j // PAGE, mask=mask, other=0)
    return page.to(tl.int64) * PAGE + j % PAGE


@triton.jit
def _shrink_kernel(
    x_ptr,
    stride_xt,
    a_ptr,
    stride_as,
    stride_ar,
    v_ptr,
    stride_vk,
    stride_vs,
    stride_vt,
    tiles_ptr,
    num_tiles_ptr,
    order_ptr,
    page_table_ptr,
    ranks_ptr,
    K,
    NUM_SLICES: tl.constexpr,
    SLICES_P2: tl.constexpr,
    PAGE: tl.constexpr,
    MAX_PAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # program (g, k): tiles g, g+G, ...; K range [k*K_PER_SPLIT, (k+1)*K_PER_SPLIT) -> v plane k.
    pid_g = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_g = tl.num_programs(0)
    num_tiles = tl.load(num_tiles_ptr)
    offs_m = tl.arange(0, BLOCK_M)
    # All slices' rank-rows side by side: column j is slice j // BLOCK_R, rank-row r0 + j % BLOCK_R.
    offs_j = tl.arange(0, SLICES_P2 * BLOCK_R)
    j_slice = offs_j // BLOCK_R
    j_rank = offs_j % BLOCK_R
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = pid_k * K_PER_SPLIT
    for tile in range(pid_g, num_tiles, num_g):
        slot = tl.load(tiles_ptr + tile * 3)
        start = tl.load(tiles_ptr + tile * 3 + 1)
        count = tl.load(tiles_ptr + tile * 3 + 2)
        rank = tl.load(ranks_ptr + slot)
        m_mask = offs_m < count
        tok = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        x_rows = x_ptr + tok * stride_xt  # [BM]
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + j_rank
            j_mask = (j_slice < NUM_SLICES) & (rr < rank)
            phys = _rows(page_table_ptr, slot, rr, j_mask, PAGE, MAX_PAGES)
            a_rows = a_ptr + j_slice.to(tl.int64) * stride_as + phys * stride_ar  # [J]
            acc = tl.zeros((BLOCK_M, SLICES_P2 * BLOCK_R), dtype=tl.float32)
            for k0 in range(0, K_PER_SPLIT, BLOCK_K):
                kk = k_begin + k0 + offs_k
                k_mask = kk < K
                xt = tl.load(x_rows[:, None] + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                at = tl.load(a_rows[:, None] + kk[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)
                acc += tl.dot(xt, tl.trans(at), input_precision=PRECISION)
            v_ptrs = v_ptr + pid_k * stride_vk + j_slice[None, :] * stride_vs + tok[:, None] * stride_vt + rr[None, :]
            tl.store(v_ptrs, acc, mask=m_mask[:, None] & j_mask[None, :])


@triton.jit
def _expand_kernel(
    v_ptr,
    stride_vk,
    stride_vs,
    stride_vt,
    bt_ptr,
    stride_br,
    y_ptr,
    stride_yt,
    tiles_ptr,
    num_tiles_ptr,
    order_ptr,
    page_table_ptr,
    ranks_ptr,
    scales_ptr,
    starts_ptr,
    N,
    NUM_SLICES: tl.constexpr,
    SPLIT: tl.constexpr,
    PAGE: tl.constexpr,
    MAX_PAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # program (g, n): tiles g, g+G, ...; columns [n*BLOCK_N, (n+1)*BLOCK_N), all inside one slice.
    pid_g = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_g = tl.num_programs(0)
    num_tiles = tl.load(num_tiles_ptr)
    n0 = pid_n * BLOCK_N
    sl = 0
    for i in tl.static_range(1, NUM_SLICES):
        sl += (n0 >= tl.load(starts_ptr + i)).to(tl.int32)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    for tile in range(pid_g, num_tiles, num_g):
        slot = tl.load(tiles_ptr + tile * 3)
        start = tl.load(tiles_ptr + tile * 3 + 1)
        count = tl.load(tiles_ptr + tile * 3 + 2)
        rank = tl.load(ranks_ptr + slot)
        scale = tl.load(scales_ptr + slot)
        m_mask = offs_m < count
        tok = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        v_rows = v_ptr + sl * stride_vs + tok * stride_vt  # [BM]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + offs_r
            r_mask = rr < rank
            vmask = m_mask[:, None] & r_mask[None, :]
            vs = tl.load(v_rows[:, None] + rr[None, :], mask=vmask, other=0.0)
            for k in tl.static_range(1, SPLIT):
                vs += tl.load(v_rows[:, None] + k * stride_vk + rr[None, :], mask=vmask, other=0.0)
            phys = _rows(page_table_ptr, slot, rr, r_mask, PAGE, MAX_PAGES)
            bt = tl.load(bt_ptr + phys[:, None] * stride_br + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :])
            acc += tl.dot(vs.to(bt.dtype), bt, input_precision=PRECISION)
        y_ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        yt = tl.load(y_ptrs, mask=y_mask)
        tl.store(y_ptrs, (yt.to(tl.float32) + scale * acc).to(yt.dtype), mask=y_mask)


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Tile sizes and grid bounds; ``pick_config`` derives one per (meta, module, call)."""

    block_r: int = 16
    block_k: int = 128
    block_n: int = 256
    split_k: int = 1
    shrink_programs: int = 1024  # upper bound on grid dim 0 x split for shrink
    expand_programs: int = 2048  # upper bound on grid dim 0 x dim 1 for expand
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_r", "block_k", "block_n", "split_k"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two, got {v}")
        if self.block_r < 16 or self.block_n < 16 or self.block_k < 16:
            raise ValueError("LaunchConfig block sizes must be >= 16 (tl.dot's minimum)")


def _pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def pick_config(meta: LoRABatchMeta, in_dim: int, out_dims: tuple[int, ...], dtype: torch.dtype) -> LaunchConfig:
    """Heuristic launch shape. Under ``meta.capture`` it depends on the buffers' capacity only, so a
    captured graph stays valid for any batch that fits."""
    device = meta.device
    sms = _num_sms(device)
    tiles_bound = meta.capacity if meta.capture else max(1, meta.host_num_tiles)
    # Prefill (not captured) takes the whole rank in one chunk: x is then read once per k-step.
    block_r = 16 if meta.capture else min(128, _pow2_at_least(meta.host_max_rank, 16))
    if meta.tile_m >= 64 and not meta.capture:
        block_k = 64 if block_r * len(out_dims) <= 128 else 32
    else:
        block_k = 128
    # Split K until ~2 programs per SM are busy reading A; partial planes are summed by expand.
    split = 1
    while tiles_bound * split * 2 <= 2 * sms and in_dim // (split * 2) >= block_k:
        split *= 2
    gcd = 0
    for w in out_dims:
        gcd = w if gcd == 0 else _gcd(gcd, w)
    block_n = min(256 if meta.tile_m <= 16 else 128, gcd & -gcd)
    return LaunchConfig(block_r=block_r, block_k=block_k, block_n=block_n, split_k=split)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def shrink_triton(
    x: torch.Tensor,
    a: torch.Tensor,
    page_table: torch.Tensor,
    ranks: torch.Tensor,
    meta: LoRABatchMeta,
    page_rank: int,
    max_rank: int,
    cfg: LaunchConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: as ``reference.shrink_torch``, but v entries outside each token's rank, and rows
    without an adapter, are left unwritten (expand never reads them), and v carries ``cfg.split_k``
    partial planes whose sum is the result.

    x: [T, K]; a: [S, rows, K]. Returns v: [split_k, S, T, max_rank] float32 (``out`` if given).
    """
    num_slices, _, k_dim = a.shape
    shape = (cfg.split_k, num_slices, x.shape[0], max_rank)
    if out is not None and (out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 {shape}, got {tuple(out.shape)} {out.dtype}")
    v = out if out is not None else torch.empty(shape, dtype=torch.float32, device=x.device)
    k_per = -(-k_dim // cfg.split_k)
    k_per = -(-k_per // cfg.block_k) * cfg.block_k
    bound = meta.capacity if meta.capture else meta.host_num_tiles
    g = max(1, min(bound, cfg.shrink_programs // cfg.split_k))
    if not meta.capture and meta.host_num_tiles == 0:
        return v
    _shrink_kernel[(g, cfg.split_k)](
        x, x.stride(0), a, a.stride(0), a.stride(1), v, v.stride(0), v.stride(1), v.stride(2),
        meta.tiles, meta.num_tiles, meta.token_order, page_table, ranks, k_dim,
        NUM_SLICES=num_slices, SLICES_P2=_pow2_at_least(num_slices, 1), PAGE=page_rank,
        MAX_PAGES=page_table.shape[1], BLOCK_M=meta.tile_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k,
        K_PER_SPLIT=k_per, PRECISION=_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return v


def expand_triton(
    y: torch.Tensor,
    v: torch.Tensor,
    bt: torch.Tensor,
    page_table: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out_starts: torch.Tensor,
    meta: LoRABatchMeta,
    page_rank: int,
    cfg: LaunchConfig,
) -> torch.Tensor:
    """Semantics: as ``reference.expand_torch`` with v summed over its split planes. In place.

    y: [T, N]; v: [split_k, S, T, R] float32; bt: [rows, N]; out_starts: int32 [S + 1] on y's device.
    """
    n_dim = y.shape[1]
    if y.stride(1) != 1 or bt.stride(1) != 1:
        raise ValueError("y and bt must be contiguous along their last dimension")
    n_tiles = -(-n_dim // cfg.block_n)
    bound = meta.capacity if meta.capture else meta.host_num_tiles
    if not meta.capture and bound == 0:
        return y
    g = max(1, min(bound, cfg.expand_programs // n_tiles))
    _expand_kernel[(g, n_tiles)](
        v, v.stride(0), v.stride(1), v.stride(2), bt, bt.stride(0), y, y.stride(0),
        meta.tiles, meta.num_tiles, meta.token_order, page_table, ranks, scales, out_starts, n_dim,
        NUM_SLICES=v.shape[1], SPLIT=v.shape[0], PAGE=page_rank, MAX_PAGES=page_table.shape[1],
        BLOCK_M=meta.tile_m, BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, PRECISION=_precision(y.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y
