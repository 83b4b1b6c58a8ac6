"""Plain-torch multi-LoRA ops: the specification of the Triton kernels and the engine's CPU path.

Each op gathers an adapter's rank-rows through the page table and multiplies, one adapter group at a
time (``meta.groups``), so work and memory follow each adapter's own rank. Shapes: T tokens, K = in_dim,
N = sum of slice widths, S slices, R = the pool's max rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .metadata import LoRABatchMeta

__all__ = ["expand_torch", "phys_rows", "shrink_torch"]


def phys_rows(page_table: torch.Tensor, slot: int, rank: int, page_rank: int) -> torch.Tensor:
    """Physical pool row of each rank-row 0..rank-1 of ``slot``: int64 [rank]."""
    j = torch.arange(rank, device=page_table.device)
    return page_table[slot, j // page_rank].long() * page_rank + j % page_rank


def shrink_torch(
    x: torch.Tensor,
    a: torch.Tensor,
    page_table: torch.Tensor,
    ranks: Sequence[int],
    meta: LoRABatchMeta,
    page_rank: int,
    max_rank: int,
) -> torch.Tensor:
    """Semantics: v[s, t, j] = sum_k x[t, k] * A_{a(t), s}[j, k] for j < rank(a(t)), else 0; rows with
    no adapter are 0.

    x: [T, K]; a: [S, rows, K] pool buffer; page_table: [slots, max_pages]; ranks: host rank per slot.
    Returns v: [S, T, max_rank] float32.
    """
    v = torch.zeros(a.shape[0], x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    for slot, idx in meta.groups:
        r = int(ranks[slot])
        idx = idx.to(x.device)
        rows = phys_rows(page_table, slot, r, page_rank)
        a_s = a[:, rows].float()  # [S, r, K]
        v[:, idx, :r] = torch.einsum("tk,srk->str", x[idx].float(), a_s)
    return v


def expand_torch(
    y: torch.Tensor,
    v: torch.Tensor,
    bt: torch.Tensor,
    page_table: torch.Tensor,
    ranks: Sequence[int],
    scales: Sequence[float],
    meta: LoRABatchMeta,
    page_rank: int,
    out_starts: Sequence[int],
) -> torch.Tensor:
    """Semantics: y[t, c] += scale(a(t)) * sum_{j < rank(a(t))} v[s(c), t, j] * B_{a(t)}^T[j, c], where
    s(c) is the slice holding column c; rows with no adapter are left as they were. In place; returns y.

    y: [T, N]; v: [S, T, R] float32; bt: [rows, N] pool buffer (B^T rows, slices side by side);
    out_starts: (0, w0, w0+w1, ..., N).
    """
    for slot, idx in meta.groups:
        r = int(ranks[slot])
        idx = idx.to(y.device)
        rows = phys_rows(page_table, slot, r, page_rank)
        b_t = bt[rows].float()  # [r, N]
        delta = torch.empty(idx.numel(), y.shape[1], dtype=torch.float32, device=y.device)
        for s in range(len(out_starts) - 1):
            c0, c1 = out_starts[s], out_starts[s + 1]
            delta[:, c0:c1] = v[s, idx, :r] @ b_t[:, c0:c1]
        y[idx] = (y[idx].float() + float(scales[slot]) * delta).to(y.dtype)
    return y
