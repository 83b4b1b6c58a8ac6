"""Triton multi-LoRA shrink and expand over a paged pool: launch shapes, argument lists, entry points.

The kernels themselves, and why they are shaped as they are, are in triton_kernels.py.
Launch shapes (``LaunchConfig``, ``pick_config``) live in launch_config.py and are re-exported here.
"""

from __future__ import annotations

import math

import torch

from loraplane.kernels.fast_launch import FastLaunch
from loraplane.kernels.launch_config import (
    LaunchConfig,
    align_hint,
    pick_config,
    pow2_at_least,
    slice_geometry,
)
from loraplane.kernels.metadata import LoRABatchMeta
from loraplane.kernels.triton_kernels import _expand_kernel, _shrink_kernel

__all__ = [
    "LaunchConfig",
    "check_expand_geometry",
    "expand_geometry",
    "expand_args",
    "expand_launch",
    "expand_triton",
    "pick_config",
    "shrink_args",
    "shrink_launch",
    "shrink_triton",
]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def shrink_launch(x, a, page_table, meta: LoRABatchMeta, page_rank: int, max_rank: int, cfg: LaunchConfig,
                  pools: int = 0):  # fmt: skip
    """Launch shape of one shrink: (FastLaunch or None when there is no work, v's shape). ``pools`` > 0:
    that many single-slice pools side by side (``shrink_args`` with their offsets)."""
    num_slices, _, k_dim = a.shape
    if pools:
        num_slices = pools
    shape = (cfg.split_k, num_slices, x.shape[0], max_rank)
    bound = meta.capacity if meta.capture else meta.host_num_tiles
    if not meta.capture and bound == 0:
        return None, shape
    k_per = -(-k_dim // cfg.split_k)
    k_per = -(-k_per // cfg.block_k) * cfg.block_k
    g = max(1, min(bound, cfg.shrink_programs // cfg.split_k, cfg.tile_programs or bound))
    constexprs = dict(
        NUM_SLICES=num_slices, SLICES_P2=pow2_at_least(num_slices, 1), PAGE=page_rank,
        MAX_PAGES=page_table.shape[1], BLOCK_M=meta.tile_m, SMALL_R=min(16, cfg.shrink_block_r),
        BLOCK_R=cfg.shrink_block_r, BLOCK_K=cfg.block_k, K_PER_SPLIT=k_per, PRECISION=_precision(x.dtype),
        X_ALIGN=align_hint(x.stride(0)), A_ALIGN=align_hint(math.gcd(a.stride(0), a.stride(1))),
        K_ALIGN=align_hint(k_dim), MULTI=bool(pools),
    )  # fmt: skip
    launch = FastLaunch(_shrink_kernel, (g, cfg.split_k), constexprs, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)  # fmt: skip
    return launch, shape


def shrink_args(x, a, v, page_table, ranks, meta: LoRABatchMeta, offsets: tuple = (0,) * 9) -> tuple:
    """The shrink kernel's run-time arguments, in order; ``offsets``: (A x3, page table x3, ranks x3)
    element offsets of pools 1..3 from pool 0's tensors (``pools`` launches only)."""
    bound = meta.capacity if meta.capture else meta.host_num_tiles
    return (x, x.stride(0), a, a.stride(0), a.stride(1), v, v.stride(0), v.stride(1), v.stride(2),
            meta.tiles, bound, meta.token_order, page_table, ranks, a.shape[2], *offsets)  # fmt: skip


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
    launch, shape = shrink_launch(x, a, page_table, meta, page_rank, max_rank, cfg)
    if out is not None and (out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 {shape}, got {tuple(out.shape)} {out.dtype}")
    v = out if out is not None else torch.empty(shape, dtype=torch.float32, device=x.device)
    if launch is not None:
        launch(*shrink_args(x, a, v, page_table, ranks, meta))
    return v


def expand_geometry(y, bt, out_dims, slice_starts, meta: LoRABatchMeta, n_chunk: int, pools: bool):
    """Checks, then (tile bound, column chunks, ``slice_geometry``'s constexprs) of an expand with chunks
    of ``n_chunk`` columns, or None when there is no work (an eager step without tiles)."""
    check_expand_geometry(y, bt, out_dims, slice_starts, pools)
    bound = meta.capacity if meta.capture else meta.host_num_tiles
    if not meta.capture and bound == 0:
        return None
    packed = (0,) * len(out_dims) if pools else None
    chunks, geo = slice_geometry(tuple(out_dims), tuple(slice_starts), n_chunk, packed)
    return bound, chunks, geo


def check_expand_geometry(y, bt, out_dims, slice_starts, pools: bool) -> None:
    """y and B^T contiguous along their rows, B^T as wide as the slices (one slice when ``pools``), y wide
    enough to hold every slice at its start; else ValueError."""
    if y.stride(1) != 1 or bt.stride(1) != 1:
        raise ValueError("y and bt must be contiguous along their last dimension")
    if (bt.shape[1] != (out_dims[0] if pools else sum(out_dims))) or y.shape[1] < max(
        c + w for c, w in zip(slice_starts, out_dims, strict=True)
    ):
        raise ValueError(
            f"bt [{bt.shape[1]} cols] and y [{y.shape[1]} cols] do not hold slices {out_dims} at {slice_starts}"
        )


def expand_launch(y, bt, page_table, out_dims, slice_starts, meta: LoRABatchMeta, page_rank: int,
                  cfg: LaunchConfig, num_slices: int, split: int, pools: bool = False):  # fmt: skip
    """Launch shape of one expand (FastLaunch), or None when there is no work. Checks the geometry.
    ``pools``: every slice from its own single-slice pool (its B^T columns start at 0)."""
    shape = expand_geometry(y, bt, out_dims, slice_starts, meta, cfg.n_chunk, pools)
    if shape is None:
        return None
    bound, chunks, geo = shape
    g = max(1, min(bound, cfg.expand_programs // chunks, cfg.tile_programs or bound))
    constexprs = dict(
        NUM_SLICES=num_slices, SPLIT=split, PAGE=page_rank, MAX_PAGES=page_table.shape[1],
        BLOCK_M=meta.tile_m, SMALL_R=min(16, cfg.block_r), BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n,
        N_CHUNK=cfg.n_chunk, BLOCK_K=cfg.block_k, FUSED=cfg.fused, PRECISION=_precision(y.dtype), **geo,
        Y_ALIGN=align_hint(y.stride(0)), B_ALIGN=align_hint(bt.stride(0)), MULTI=pools, STORE=cfg.store,
    )  # fmt: skip
    return FastLaunch(_expand_kernel, (g, chunks), constexprs, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)  # fmt: skip


def expand_args(y, v, bt, page_table, ranks, scales, meta: LoRABatchMeta, x=None, a=None,
                offsets: tuple = (0,) * 15) -> tuple:  # fmt: skip
    """The expand kernel's run-time arguments, in order (v None: the fused form reads x and a).
    ``offsets``: (B^T x3, B^T row strides x3, page table x3, ranks x3, scales x3) of pools 1..3, element
    offsets from pool 0's tensors (``pools`` launches only)."""
    bound = meta.capacity if meta.capture else meta.host_num_tiles
    if v is None:
        v_args = (y, 0, 0, 0)
        x_args = (x, x.stride(0), a, a.stride(0), a.stride(1), a.shape[2])
    else:
        v_args = (v, v.stride(0), v.stride(1), v.stride(2))
        x_args = (y, 0, y, 0, 0, 0)
    return (*v_args, *x_args, bt, bt.stride(0), y, y.stride(0), meta.tiles, bound, meta.token_order,
            page_table, ranks, scales, *offsets)  # fmt: skip


def expand_triton(
    y: torch.Tensor,
    v: torch.Tensor | None,
    bt: torch.Tensor,
    page_table: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out_dims: tuple[int, ...],
    slice_starts: tuple[int, ...],
    meta: LoRABatchMeta,
    page_rank: int,
    cfg: LaunchConfig,
    x: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: as ``reference.expand_torch`` with v summed over its split planes. In place: only the
    columns [slice_starts[s], slice_starts[s] + out_dims[s]) of adapter rows change. With ``cfg.fused``,
    v is None and computed in-kernel from ``x`` [T, K] and ``a`` [S, rows, K] (one launch in total).

    y: [T, >= every slice's end]; v: [split_k, S, T, R] float32; bt: [rows, sum(out_dims)] (packed).
    """
    if cfg.fused and (x is None or a is None):
        raise ValueError("a fused expand needs x and a")
    num_slices, split = (a.shape[0], 1) if cfg.fused else (v.shape[1], v.shape[0])
    launch = expand_launch(y, bt, page_table, out_dims, slice_starts, meta, page_rank, cfg, num_slices, split)
    if launch is not None:
        launch(*expand_args(y, None if cfg.fused else v, bt, page_table, ranks, scales, meta, x, a))
    return y
