"""Plain-torch multi-LoRA ops: the specification of the Triton kernels and the engine's CPU path.

Each op gathers an adapter's rank-rows through the page table and multiplies, one adapter group at a
time (``meta.groups``), so work and memory follow each adapter's own rank. Shapes: T tokens, K = in_dim,
N = sum of slice widths, S slices, R = the pool's max rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplane.kernels.metadata import LoRABatchMeta

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
    slice_starts: Sequence[int] | None = None,
) -> torch.Tensor:
    """Semantics: y[t, y_s + c] += scale(a(t)) * sum_{j < rank(a(t))} v[s, t, j] * B_{a(t)}^T[j, p_s + c]
    for each slice s and 0 <= c < w_s, where p_s = out_starts[s] (packed B^T column), w_s its width and
    y_s = slice_starts[s] (default p_s); rows with no adapter and columns outside every slice are left as
    they were. In place; returns y.

    y: [T, >= every y_s + w_s]; v: [S, T, R] float32; bt: [rows, N] pool buffer (B^T rows, slices side
    by side); out_starts: (0, w0, w0+w1, ..., N).
    """
    ys = list(out_starts[:-1]) if slice_starts is None else list(slice_starts)
    for slot, idx in meta.groups:
        r = int(ranks[slot])
        idx = idx.to(y.device)
        rows = phys_rows(page_table, slot, r, page_rank)
        b_t = bt[rows].float()  # [r, N]
        for s in range(len(out_starts) - 1):
            c0, c1 = out_starts[s], out_starts[s + 1]
            cols = slice(ys[s], ys[s] + c1 - c0)
            delta = v[s, idx, :r] @ b_t[:, c0:c1]  # [n, w_s]
            y[idx, cols] = (y[idx, cols].float() + float(scales[slot]) * delta).to(y.dtype)
    return y
