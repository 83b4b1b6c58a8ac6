"""``lora_apply`` on the Triton kernels: shrink then expand, with launch shapes kept per step.

A step's batch metadata is shared by every layer, so a (metadata, module, token count) fixes both
launches' grids and compile-time values: ``ApplyPlan`` works them out on the first layer and every later
layer only passes its own tensors (``FastLaunch``: no per-call binding in Triton). ``PoolsPlan`` does the
same for several single-slice pools that share the input (q, k, v; gate, up): one shrink and one expand
launch for all of them, each pool's tensors addressed as element offsets from the first pool's.
"""

from __future__ import annotations

import dataclasses

import torch
from triton.runtime.errors import OutOfResources

from loraplane.kernels.launch_config import LaunchConfig, capture_policy
from loraplane.kernels.metadata import LoRABatchMeta
from loraplane.kernels.overlap import lora_beside, shrink_beside
from loraplane.kernels.triton_decode import decode_expand_launch, decode_shrink_launch
from loraplane.kernels.triton_fused import fused_args, fused_launch
from loraplane.kernels.triton_ops import expand_args, expand_launch, shrink_args, shrink_launch

__all__ = ["ApplyPlan", "PoolsPlan", "lora_apply_pools_triton", "lora_apply_triton"]


class ApplyPlan:
    """Both launches of one ``lora_apply`` shape, worked out once per (step metadata, module, token
    count) and replayed for every layer: the per-layer host work is two direct launches.

    v (the shrink output) belongs to the metadata (``meta.scratch_f32``), not to the plan: plans are
    dropped at every build, but a CUDA graph captured over the metadata keeps v's address, so v must live
    as long as the metadata. The layers run in stream order, so each layer's shrink overwrites it only
    after the previous layer's expand has read it.
    """

    __slots__ = ("cfg", "shrink", "expand", "v", "one")

    def __init__(self, y, x, a, bt, pool_tables: tuple, out_dims, slice_starts, meta: LoRABatchMeta,
                 cfg: LaunchConfig) -> None:  # fmt: skip
        page_table, _, _, page_rank, max_rank = pool_tables
        self.cfg = cfg = _FALLBACK.get(cfg, cfg)
        self.shrink, self.v, self.one = None, None, None
        if cfg.one_launch:  # shrink and expand in one launch (triton_fused)
            self.one, shape = fused_launch(x, a, y, bt, page_table, meta, page_rank, max_rank, cfg, out_dims,
                                           slice_starts)  # fmt: skip
            self.v = meta.scratch_f32(shape, x.device)
            self.expand = self.one or None
            return
        if cfg.decode:  # decode-shaped kernels (triton_decode): same arguments, one round of loads each
            self.shrink, shape = decode_shrink_launch(x, a, page_table, meta, page_rank, max_rank, cfg)
            self.v = meta.scratch_f32(shape, x.device)
            self.expand = decode_expand_launch(y, bt, page_table, out_dims, slice_starts, meta, page_rank, cfg,
                                               shape[1], shape[0])  # fmt: skip
            return
        if not cfg.fused:
            self.shrink, shape = shrink_launch(x, a, page_table, meta, page_rank, max_rank, cfg)
            self.v = meta.scratch_f32(shape, x.device)  # outlives the plan: graphs keep its address
        num_slices, split = (a.shape[0], 1) if cfg.fused else (self.v.shape[1], self.v.shape[0])
        self.expand = expand_launch(y, bt, page_table, out_dims, slice_starts, meta, page_rank, cfg,
                                    num_slices, split)  # fmt: skip

    def run(self, y, x, a, bt, page_table, ranks, scales, meta: LoRABatchMeta, page_table_b=None,
            base=None, side=None):  # fmt: skip
        """Launch for one layer's tensors. ``page_table_b``: expand's own table (default: the shrink's).
        ``base``: writes y (the base GEMM) before the expand; with ``side``, beside the shrink."""
        if self.expand is None:
            shrink_beside(None, base, None)
            return y
        pt_b = page_table if page_table_b is None else page_table_b
        if self.one is not None:
            shrink_beside(None, base, None)
            for launch in self.one:
                launch(*fused_args(x, a, self.v, y, bt, page_table, pt_b, ranks, scales, meta))
            return y
        shrink = None
        if self.shrink is not None:
            shrink = lambda: self.shrink(*shrink_args(x, a, self.v, page_table, ranks, meta))  # noqa: E731
        expand = lambda out: self.expand(*expand_args(out, self.v, bt, pt_b, ranks, scales, meta, x, a))  # noqa: E731
        _run_pair(shrink, expand, base, side, y, x)
        return y


def lora_apply_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    pool_tables: tuple,
    out_dims: tuple[int, ...],
    slice_starts: tuple[int, ...],
    meta: LoRABatchMeta,
    cfg: LaunchConfig,
    plans: dict | None = None,
    key=None,
    page_table_b: torch.Tensor | None = None,
    base=None,
    side=None,
) -> torch.Tensor:
    """shrink + expand (or the fused expand alone). ``pool_tables`` = (page_table, ranks, scales,
    page_rank, max_rank); slices as in ``ModuleSpec``; ``page_table_b``: expand's own page table (default:
    the shared one). With ``plans`` (a dict that lives as long as ``meta``'s contents, e.g.
    ``meta.plans``) the launch shapes are kept under ``key`` for later calls. ``base``/``side``: as in
    ``ApplyPlan.run`` (``base`` writes all of y, so a retry after a failed first compile may run it again)."""
    page_table, ranks, scales, _, _ = pool_tables
    plan = plans.get(key) if plans is not None else None
    if plan is not None:
        return plan.run(y, x, a, bt, page_table, ranks, scales, meta, page_table_b, base, side)
    plan = ApplyPlan(y, x, a, bt, pool_tables, out_dims, slice_starts, meta, cfg)
    try:
        plan.run(y, x, a, bt, page_table, ranks, scales, meta, page_table_b, base, side)
    except OutOfResources:
        # Compilation happens on the first call (never inside a graph capture): retry with shallower
        # pipelines and narrower K tiles, and remember the choice.
        if plan.cfg.num_stages <= 2 and plan.cfg.block_k <= 32:
            raise
        smaller = dataclasses.replace(plan.cfg, num_stages=2, block_k=max(32, plan.cfg.block_k // 2))
        _FALLBACK[cfg] = _FALLBACK[plan.cfg] = smaller
        return lora_apply_triton(
            y,
            x,
            a,
            bt,
            pool_tables,
            out_dims,
            slice_starts,
            meta,
            smaller,
            plans,
            key,
            page_table_b,
            base,
            side,
        )
    if plans is not None:
        plans[key] = plan
    return y


def _offset(t: torch.Tensor, t0: torch.Tensor) -> int:
    """Element offset of ``t``'s data from ``t0``'s (same dtype)."""
    d = t.data_ptr() - t0.data_ptr()
    if t.dtype != t0.dtype or d % t.element_size():
        raise ValueError(f"pool tensors of {t.dtype} and {t0.dtype} are not element-aligned to each other")
    return d // t.element_size()


def _pad3(vals) -> tuple:
    vals = tuple(vals)
    return vals + (0,) * (3 - len(vals))


class PoolsPlan:
    """One shrink and one expand over single-slice pools that share x and the step's metadata (one slot
    numbering): pool i's module is slice i, its output at y columns ``starts[i]``. Same split of work
    as a packed module of those widths; a slot of rank 0 in one pool (an adapter without that module)
    costs that slice nothing."""

    __slots__ = ("cfg", "shrink", "expand", "v", "tables", "one")

    def __init__(self, y, x, pools, modules, starts, layer: int, meta: LoRABatchMeta, cfg: LaunchConfig):
        p0 = pools[0]
        self.cfg = cfg = dataclasses.replace(_FALLBACK.get(cfg, cfg), fused=False)
        widths = tuple(p.modules[m].out_dims[0] for p, m in zip(pools, modules, strict=True))
        a0, bt0 = p0.a[(layer, modules[0])], p0.bt[(layer, modules[0])]
        max_rank = max(p.max_rank for p in pools)
        pt_b = [_expand_table(p) for p in pools]
        self.one = None
        if cfg.one_launch:  # shrink and expand in one launch (triton_fused)
            self.one, shape = fused_launch(x, a0, y, bt0, p0.page_table, meta, p0.page_rank, max_rank, cfg,
                                           widths, tuple(starts), len(pools))  # fmt: skip
            self.shrink, self.expand = None, self.one or None
        elif cfg.decode:  # decode-shaped kernels (triton_decode)
            self.shrink, shape = decode_shrink_launch(x, a0, p0.page_table, meta, p0.page_rank, max_rank, cfg,
                                                      len(pools))  # fmt: skip
            self.expand = decode_expand_launch(y, bt0, pt_b[0], widths, tuple(starts), meta, p0.page_rank, cfg,
                                               len(pools), shape[0], pools=True)  # fmt: skip
        else:
            self.shrink, shape = shrink_launch(
                x, a0, p0.page_table, meta, p0.page_rank, max_rank, cfg, len(pools)
            )
            self.expand = expand_launch(y, bt0, pt_b[0], widths, tuple(starts), meta, p0.page_rank, cfg,
                                        len(pools), shape[0], pools=True)  # fmt: skip
        self.v = meta.scratch_f32(shape, x.device)  # outlives the plan: graphs keep its address
        rest = pools[1:]
        self.tables = (
            _pad3(_offset(p.page_table, p0.page_table) for p in rest),
            _pad3(_offset(p.ranks, p0.ranks) for p in rest),
            _pad3(_offset(p.scales, p0.scales) for p in rest),
            _pad3(_offset(t, pt_b[0]) for t in pt_b[1:]),
        )

    def run(self, y, x, pools, modules, layer: int, meta: LoRABatchMeta, base=None, side=None):
        """Launch for one layer's tensors; ``base``/``side`` as in ``ApplyPlan.run``."""
        if self.expand is None:
            shrink_beside(None, base, None)
            return y
        p0, m0 = pools[0], modules[0]
        a0, bt0 = p0.a[(layer, m0)], p0.bt[(layer, m0)]
        ao = _pad3(_offset(p.a[(layer, m)], a0) for p, m in zip(pools[1:], modules[1:], strict=True))
        bts = [p.bt[(layer, m)] for p, m in zip(pools[1:], modules[1:], strict=True)]
        bo, bs = _pad3(_offset(b, bt0) for b in bts), _pad3(b.stride(0) for b in bts)
        pto, rko, sco, pto_b = self.tables
        if self.one is not None:
            shrink_beside(None, base, None)
            offsets = (*ao, *pto, *rko, *bo, *bs, *pto_b, *sco)
            for launch in self.one:
                launch(*fused_args(x, a0, self.v, y, bt0, p0.page_table, _expand_table(p0), p0.ranks, p0.scales,
                                   meta, offsets))  # fmt: skip
            return y
        offsets = (*bo, *bs, *pto_b, *rko, *sco)
        _run_pair(
            lambda: self.shrink(
                *shrink_args(x, a0, self.v, p0.page_table, p0.ranks, meta, (*ao, *pto, *rko))
            ),
            lambda out: self.expand(
                *expand_args(out, self.v, bt0, _expand_table(p0), p0.ranks, p0.scales, meta, offsets=offsets)
            ),
            base,
            side,
            y,
            x,
        )
        return y


def _run_pair(shrink, expand, base, side, y, x) -> None:
    """Shrink, base and expand (into ``y``) in the order the capture policy asks: the shrink beside the
    GEMM, or, where x's width times y's is at least ``expand_beside`` (the projection's weight elements
    for the engine's launches), the whole pair beside it into a delta added after the join. Eager launches
    (no ``side``) read no policy."""
    if side is not None and base is not None:
        beside = capture_policy().expand_beside
        if beside and x.shape[1] * y.shape[1] >= beside:
            lora_beside(shrink, expand, base, side, y)
            return
    shrink_beside(shrink, base, side)
    expand(y)


def _expand_table(pool) -> torch.Tensor:
    """The page table expand reads: the pool's own B-side table where it keeps one."""
    table = getattr(pool, "page_table_b", None)
    return pool.page_table if table is None else table


def lora_apply_pools_triton(y, x, pools, modules, starts, layer: int, meta: LoRABatchMeta, cfg: LaunchConfig,
                            plans: dict | None = None, key=None, base=None, side=None) -> torch.Tensor:  # fmt: skip
    """``PoolsPlan`` launches (kept in ``plans`` under ``key``), with the same fallback to smaller tiles
    as ``lora_apply_triton`` when a first compile runs out of shared memory."""
    plan = plans.get(key) if plans is not None else None
    if plan is not None:
        return plan.run(y, x, pools, modules, layer, meta, base, side)
    plan = PoolsPlan(y, x, pools, modules, starts, layer, meta, cfg)
    try:
        plan.run(y, x, pools, modules, layer, meta, base, side)
    except OutOfResources:
        if plan.cfg.num_stages <= 2 and plan.cfg.block_k <= 32:
            raise
        smaller = dataclasses.replace(plan.cfg, num_stages=2, block_k=max(32, plan.cfg.block_k // 2))
        _FALLBACK[cfg] = _FALLBACK[plan.cfg] = smaller
        return lora_apply_pools_triton(
            y, x, pools, modules, starts, layer, meta, smaller, plans, key, base, side
        )
    if plans is not None:
        plans[key] = plan
    return y


_FALLBACK: dict[LaunchConfig, LaunchConfig] = {}
