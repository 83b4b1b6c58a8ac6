"""The engine's entry point: ``lora_apply`` adds every token's LoRA delta for one (layer, module).

Dispatch: Triton on CUDA tensors; the plain-torch path (reference.py) on CPU. Tests force the Triton
path on CPU (``backend="triton"``) under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from loraplane.kernels.launch_config import capture_policy
from loraplane.kernels.metadata import LoRABatchMeta
from loraplane.kernels.overlap import beside_stream
from loraplane.kernels.pool import LoRAPool
from loraplane.kernels.reference import expand_torch, shrink_torch

__all__ = ["covers_every_row", "lora_apply", "lora_apply_many", "lora_expand", "lora_shrink"]


def lora_shrink(
    x: torch.Tensor, pool: LoRAPool, layer: int, module: str, meta: LoRABatchMeta, *, backend="auto"
):
    """Semantics: v[s, t, :r] = x[t] @ A_{a(t), s}^T for every token with an adapter (see shrink_torch).

    x: [T, in_dim]. Returns v: torch path [S, T, max_rank]; Triton path [split_k, S, T, max_rank]
    (sum the planes). Only expand needs to read it; ``lora_apply`` pairs them.
    """
    spec, a, _ = _checked(x, pool, layer, module, meta)
    if _use_triton(x, backend):
        from loraplane.kernels.triton_ops import pick_config, shrink_triton

        cfg = dataclasses.replace(pick_config(meta, spec.in_dim, spec.out_dims, x.dtype), fused=False)
        return shrink_triton(x, a, pool.page_table, pool.ranks, meta, pool.page_rank, pool.max_rank, cfg)
    return shrink_torch(x, a, pool.page_table, pool.host_ranks(), meta, pool.page_rank, pool.max_rank)


def lora_expand(
    y: torch.Tensor, v: torch.Tensor, pool: LoRAPool, layer: int, module: str, meta, *, backend="auto"
):
    """Semantics: y[t, c] += scale(a(t)) * v[s(c), t, :r] @ B_{a(t), s(c)}^T[:, c] for the columns c of
    each slice s (``ModuleSpec.slice_starts``); other columns untouched. In place; returns y.

    y: [T, spec.y_width]; v from ``lora_shrink`` with the same backend.
    """
    spec = pool.modules[module]
    bt = pool.bt[(layer, module)]
    if _use_triton(y, backend):
        from loraplane.kernels.triton_ops import expand_triton, pick_config

        cfg = pick_config(meta, spec.in_dim, spec.out_dims, y.dtype)
        cfg = dataclasses.replace(cfg, split_k=v.shape[0], fused=False)
        return expand_triton(
            y, v, bt, pool.page_table, pool.ranks, pool.scales, spec.out_dims, spec.slice_starts, meta,
            pool.page_rank, cfg,
        )  # fmt: skip
    return expand_torch(
        y,
        v,
        bt,
        pool.page_table,
        pool.host_ranks(),
        pool.host_scales(),
        meta,
        pool.page_rank,
        spec.out_starts,
        spec.slice_starts,
    )


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: LoRAPool,
    layer: int,
    module: str,
    meta: LoRABatchMeta,
    *,
    backend: str = "auto",
    config=None,
    base: Callable[[], None] | None = None,
    store: bool = False,
) -> torch.Tensor:
    """Semantics: for every token t with adapter a = token_slot[t] >= 0 and every slice s,
    y[t, c_s:c_s + w_s] += scale_a * (x[t] @ A_{a,s}^T) @ B_{a,s}^T with c_s = slice_starts[s] and
    w_s = out_dims[s]; other rows and columns unchanged (bit for bit; under ``CapturePolicy.expand_beside``
    a -0.0 there may become +0.0). ``store``: the slices' columns of y become the delta alone (0 in rows
    without an adapter with this module), for a caller that adds its base GEMM on top afterwards
    (``y.addmm_(x, W^T)``); when every row has one (``covers_every_row``) y is never read, else those
    columns are zeroed first; eager launches only (no ``base``, no captured metadata).

    y: [T, spec.y_width] (the base projection's output, any float dtype of the pool), x: [T, in_dim],
    meta.num_tokens <= T <= meta.capacity (rows past num_tokens: no adapter). In place; returns y. ``config`` (a LaunchConfig)
    overrides the heuristic launch shape on the Triton path. Graph-safe when ``meta.capture`` is set.
    ``base``: a callable that writes y's base values first (the projection's GEMM; it may run more than
    once); on captured launches (``CapturePolicy.overlap``) the shrink runs beside it on a side stream.
    """
    spec, a, bt = _checked(x, pool, layer, module, meta)
    if y.dim() != 2 or y.shape != (x.shape[0], spec.y_width) or y.stride(1) != 1:
        raise ValueError(f"y must be a row-contiguous [{x.shape[0]}, {spec.y_width}], got {tuple(y.shape)}")
    if y.dtype != pool.dtype:
        raise ValueError(f"y.dtype {y.dtype} differs from the pool's {pool.dtype}")
    if store:
        _prepare_store(y, [(pool, module, 0)], x, meta, base)
    if _use_triton(x, backend):
        from loraplane.kernels.triton_apply import lora_apply_triton
        from loraplane.kernels.triton_ops import pick_config

        tables = (pool.page_table, pool.ranks, pool.scales, pool.page_rank, pool.max_rank)
        key = (id(pool), module, x.shape[0], x.stride(0), y.stride(0), config, store)
        plan, side = meta.plans.get(key), _side(x, meta, base)
        if plan is not None:  # every layer after the first of a step: launches only
            pt_b = getattr(pool, "page_table_b", None)
            return plan.run(y, x, a, bt, pool.page_table, pool.ranks, pool.scales, meta, pt_b, base, side)
        cfg = config or pick_config(meta, spec.in_dim, spec.out_dims, x.dtype)
        if store:
            cfg = dataclasses.replace(cfg, store=True)
        return lora_apply_triton(
            y, x, a, bt, tables, spec.out_dims, spec.slice_starts, meta, cfg, meta.plans, key,
            getattr(pool, "page_table_b", None), base, side,
        )  # fmt: skip
    if base is not None:
        base()
    if store:  # the reference: the delta added to zeros
        for c0, w in zip(spec.slice_starts, spec.out_dims, strict=True):
            y[:, c0 : c0 + w].zero_()
    ranks = pool.host_ranks()
    v = shrink_torch(x, a, pool.page_table, ranks, meta, pool.page_rank, pool.max_rank)
    return expand_torch(
        y, v, bt, pool.page_table, ranks, pool.host_scales(), meta, pool.page_rank, spec.out_starts,
        spec.slice_starts,
    )  # fmt: skip


def lora_apply_many(
    y: torch.Tensor,
    x: torch.Tensor,
    targets: Sequence[tuple[LoRAPool, str, int]],
    layer: int,
    meta: LoRABatchMeta,
    *,
    backend: str = "auto",
    base: Callable[[], None] | None = None,
    store: bool = False,
) -> torch.Tensor:
    """Semantics: for each (pool, module, c0) of ``targets``, ``lora_apply(y[:, c0:c0 + w], x, pool,
    layer, module, meta, store=store)`` with w the module's width: several pools that share x and one slot
    numbering (the engine's q, k, v pools; gate, up), their outputs at disjoint column ranges of y.

    y: [T, >= every c0 + w] row-contiguous; x: [T, in_dim]. In place; returns y. On the Triton path
    single-slice modules of one in_dim and page geometry take one shrink and one expand launch in all
    (``PoolsPlan``); anything else runs one ``lora_apply`` per target. ``base``: as in ``lora_apply``.
    """
    pooled = _use_triton(x, backend) and 1 < len(targets) <= 4
    key = _pools_key(y, x, targets, store) if pooled else None
    # A later layer of a step whose first layer built this plan: what was checked there holds here, as the
    # plan's key holds every argument the checks read, save the layer and its own tensors (checked here).
    later = (
        key in meta.plans
        and all(0 <= layer < pool.num_layers for pool, _, _ in targets)
        and _poolable(targets, layer)
    )
    spans = [] if later else _checked_spans(y, x, targets, layer, meta)
    if later or (pooled and _poolable(targets, layer)):
        from loraplane.kernels.triton_apply import lora_apply_pools_triton
        from loraplane.kernels.triton_ops import pick_config

        if store:  # (the per-target lora_apply below prepares its own columns)
            _prepare_store(y, targets, x, meta, base)
        pools, modules, starts = zip(*targets, strict=True)
        cfg = None
        if key not in meta.plans:
            widths = tuple(p.modules[m].out_dims[0] for p, m in zip(pools, modules, strict=True))
            cfg = pick_config(meta, x.shape[1], widths, x.dtype)
            if store:
                cfg = dataclasses.replace(cfg, store=True)
        side = _side(x, meta, base)
        return lora_apply_pools_triton(
            y, x, pools, modules, starts, layer, meta, cfg, meta.plans, key, base, side
        )
    for k, ((pool, module, c0), (_, c1)) in enumerate(zip(targets, spans, strict=True)):
        lora_apply(y[:, c0:c1], x, pool, layer, module, meta, backend=backend, base=None if k else base,
                   store=store)  # fmt: skip
    return y


def _checked_spans(y, x, targets, layer: int, meta: LoRABatchMeta) -> list[tuple[int, int]]:
    """Each target's [first, end) columns of y, once every argument is checked (else ValueError)."""
    spans = []
    for pool, module, c0 in targets:
        spec = _checked(x, pool, layer, module, meta)[0]
        spans.append((c0, c0 + spec.y_width))
    if y.dim() != 2 or y.shape[0] != x.shape[0] or y.stride(1) != 1 or y.dtype != x.dtype:
        raise ValueError(f"y must be a row-contiguous [{x.shape[0]}, ...] of {x.dtype}, got {tuple(y.shape)}")
    ordered = sorted(spans)
    if ordered and (ordered[0][0] < 0 or ordered[-1][1] > y.shape[1]):
        raise ValueError(f"targets' columns {ordered} do not fit y's {y.shape[1]}")
    for (_, e0), (b1, _) in zip(ordered, ordered[1:], strict=False):
        if b1 < e0:
            raise ValueError(f"targets' columns overlap: {ordered}")
    return spans


def _pools_key(y, x, targets, store: bool) -> tuple:
    """A step's ``PoolsPlan`` key: every argument ``lora_apply_many`` checks, save the layer."""
    pools, modules, starts = zip(*targets, strict=True)
    return ("pools", tuple(map(id, pools)), modules, starts, x.shape, x.stride(), x.dtype, x.device, y.shape,
            y.stride(), y.dtype, store)  # fmt: skip


def covers_every_row(meta: LoRABatchMeta, pool: LoRAPool, rows: int) -> bool:
    """Whether each of ``rows`` rows has an adapter of rank > 0 in ``pool``: the step's metadata holds
    exactly ``rows`` tokens, all with an adapter, and none of the step's adapters lacks this pool's
    module. Worked out once per (step, pool) (kept in ``meta.plans``, dropped at the next build)."""
    key = ("covers", id(pool), rows)
    hit = meta.plans.get(key)
    if hit is None:
        ranks = pool.host_ranks()
        hit = meta.plans[key] = (
            meta.num_tokens == rows
            and meta.rows_with_adapter() == rows
            and all(ranks[s] > 0 for s in meta.step_slots())
        )
    return hit


def _prepare_store(y: torch.Tensor, targets, x: torch.Tensor, meta: LoRABatchMeta, base) -> None:
    """Before a storing launch: refuse captured or ``base`` launches (the GEMM must come after), and zero
    the columns of any target that some row gets no delta in (a row without an adapter, or an adapter
    without the module), since the storing expand writes only the rows it has work for."""
    if base is not None or meta.capture:
        raise ValueError("store=True is for eager launches without base (the caller's GEMM adds on top)")
    for pool, module, c0 in targets:
        if not covers_every_row(meta, pool, x.shape[0]):
            spec = pool.modules[module]
            for s0, w in zip(spec.slice_starts, spec.out_dims, strict=True):
                y[:, c0 + s0 : c0 + s0 + w].zero_()


def _side(x: torch.Tensor, meta: LoRABatchMeta, base) -> torch.cuda.Stream | None:
    """The side stream a captured launch's shrink runs on beside ``base`` (None: one stream)."""
    if base is None or not meta.capture or not x.is_cuda or not capture_policy().overlap:
        return None
    return beside_stream(x.device)


def _poolable(targets, layer: int) -> bool:
    """One launch pair can serve these pools: single-slice modules, one page geometry and rank bound,
    and A rows of one stride (the shrink walks every pool's A with pool 0's row stride)."""
    p0, m0 = targets[0][0], targets[0][1]
    stride_ar = p0.a[(layer, m0)].stride(1)
    return all(
        p.modules[m].num_slices == 1
        and p.a[(layer, m)].stride(1) == stride_ar
        and p.modules[m].slice_starts == (0,)
        and p.page_rank == p0.page_rank
        and p.max_rank == p0.max_rank
        and p.page_table.shape[1] == p0.page_table.shape[1]
        and p.dtype == p0.dtype
        for p, m, _ in targets
    )


def _use_triton(t: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return backend == "triton" or (backend == "auto" and t.is_cuda)


def _checked(x: torch.Tensor, pool: LoRAPool, layer: int, module: str, meta: LoRABatchMeta):
    if module not in pool.modules:
        raise KeyError(f"module {module!r} is not in the pool (has {sorted(pool.modules)})")
    if not 0 <= layer < pool.num_layers:
        raise ValueError(f"layer must be in [0, {pool.num_layers}), got {layer}")
    spec = pool.modules[module]
    if x.dim() != 2 or x.shape[1] != spec.in_dim or x.stride(1) != 1:
        raise ValueError(f"x must be a row-contiguous [T, {spec.in_dim}], got {tuple(x.shape)}")
    if x.dtype != pool.dtype:
        raise ValueError(f"x.dtype {x.dtype} differs from the pool's {pool.dtype}")
    if not meta.num_tokens <= x.shape[0] <= meta.capacity:
        raise ValueError(
            f"x has {x.shape[0]} rows; the batch metadata needs {meta.num_tokens}..{meta.capacity} (extra rows: no adapter)"
        )
    if x.device != pool.device or meta.device != pool.device:
        raise ValueError(f"x ({x.device}), pool ({pool.device}) and meta ({meta.device}) must share a device")
    return spec, pool.a[(layer, module)], pool.bt[(layer, module)]
