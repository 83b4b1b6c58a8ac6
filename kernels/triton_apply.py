"""``lora_apply`` on the Triton kernels: shrink then expand, with launch shapes kept per step.

A step's batch metadata is shared by every layer, so a (metadata, module, token count) fixes both
launches' grids and compile-time values: ``ApplyPlan`` works them out on the first layer and every later
layer only passes its own tensors (``FastLaunch``: no per-call binding in Triton).
"""

from __future__ import annotations

import dataclasses

import torch
from triton.runtime.errors import OutOfResources

from .launch_config import LaunchConfig
from .metadata import LoRABatchMeta
from .triton_ops import expand_args, expand_launch, shrink_args, shrink_launch

__all__ = ["ApplyPlan", "lora_apply_triton"]


class ApplyPlan:
    """Both launches of one ``lora_apply`` shape, worked out once per (step metadata, module, token
    count) and replayed for every layer: the per-layer host work is two direct launches.

    v (the shrink output) is one buffer per plan: the layers run in stream order, so each layer's shrink
    overwrites it only after the previous layer's expand has read it.
    """

    __slots__ = ("cfg", "shrink", "expand", "v")

    def __init__(self, y, x, a, bt, pool_tables: tuple, out_dims, slice_starts, meta: LoRABatchMeta,
                 cfg: LaunchConfig) -> None:  # fmt: skip
        page_table, _, _, page_rank, max_rank = pool_tables
        self.cfg = cfg = _FALLBACK.get(cfg, cfg)
        self.shrink, self.v = None, None
        if not cfg.fused:
            self.shrink, shape = shrink_launch(x, a, page_table, meta, page_rank, max_rank, cfg)
            self.v = torch.empty(shape, dtype=torch.float32, device=x.device)
        num_slices, split = (a.shape[0], 1) if cfg.fused else (self.v.shape[1], self.v.shape[0])
        self.expand = expand_launch(y, bt, page_table, out_dims, slice_starts, meta, page_rank, cfg,
                                    num_slices, split)  # fmt: skip

    def run(self, y, x, a, bt, page_table, ranks, scales, meta: LoRABatchMeta, page_table_b=None):
        """Launch for one layer's tensors. ``page_table_b``: expand's own table (default: the shrink's)."""
        if self.expand is None:
            return y
        if self.shrink is not None:
            self.shrink(*shrink_args(x, a, self.v, page_table, ranks, meta))
        pt_b = page_table if page_table_b is None else page_table_b
        self.expand(*expand_args(y, self.v, bt, pt_b, ranks, scales, meta, x, a))
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
) -> torch.Tensor:
    """shrink + expand (or the fused expand alone). ``pool_tables`` = (page_table, ranks, scales,
    page_rank, max_rank); slices as in ``ModuleSpec``. With ``plans`` (a dict that lives as long as
    ``meta``'s contents, e.g. ``meta.plans``) the launch shapes are kept under ``key`` for later calls."""
    page_table, ranks, scales, _, _ = pool_tables
    plan = plans.get(key) if plans is not None else None
    if plan is not None:
        return plan.run(y, x, a, bt, page_table, ranks, scales, meta)
    plan = ApplyPlan(y, x, a, bt, pool_tables, out_dims, slice_starts, meta, cfg)
    try:
        plan.run(y, x, a, bt, page_table, ranks, scales, meta)
    except OutOfResources:
        # Compilation happens on the first call (never inside a graph capture): retry with shallower
        # pipelines and narrower K tiles, and remember the choice.
        if plan.cfg.num_stages <= 2 and plan.cfg.block_k <= 32:
            raise
        smaller = dataclasses.replace(plan.cfg, num_stages=2, block_k=max(32, plan.cfg.block_k // 2))
        _FALLBACK[cfg] = _FALLBACK[plan.cfg] = smaller
        return lora_apply_triton(y, x, a, bt, pool_tables, out_dims, slice_starts, meta, smaller, plans, key)
    if plans is not None:
        plans[key] = plan
    return y


_FALLBACK: dict[LaunchConfig, LaunchConfig] = {}
