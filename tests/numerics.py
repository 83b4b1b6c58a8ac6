"""Tolerances for comparing results that are sums of many products.

Two correct implementations that add the same products in another order (a Triton tile against a torch
matmul, two tensor-parallel shards and an all-reduce against one matmul) round differently. Each partial
sum rounds by up to eps of its own size, so an element's error grows with the length of the reduction and
with the size of the products, not with the element itself: an element whose sum cancels to near zero keeps
the rounding of its large partial sums. A bare ``atol=1e-5`` therefore holds only while the values stay near
1, and a tolerance relative to each element (rtol alone) fails on the cancelled ones. The bound here is the
classic one for a recursive sum, eps * terms * (size of the products), with the largest result standing in
for the size of the products. It stays orders of magnitude below what a real defect gives (a wrong slot,
rank, shard or scale changes elements by about their own size).
"""

from __future__ import annotations

import torch


def sum_atol(want: torch.Tensor, terms: int) -> float:
    """An absolute tolerance for ``want``'s elements, each the sum of about ``terms`` products.

    ``terms`` is the length of the reductions behind one element, added along the chain (x @ A^T @ B^T
    over in_dim and then rank: in_dim + rank; a model's logits: each layer's reductions, then the head's).
    """
    finite = want.detach().abs().nan_to_num(nan=0.0, posinf=0.0)  # NaN rows are compared as NaN, not here
    return sum_bound(finite.max().item(), terms, want.dtype)


def sum_bound(magnitude: float, terms: int, dtype: torch.dtype = torch.float32) -> float:
    """eps(dtype) * terms * magnitude: the bound for results whose largest absolute value is ``magnitude``."""
    if terms < 1:
        raise ValueError(f"terms must be at least 1, got {terms}")
    return torch.finfo(dtype).eps * terms * magnitude


def assert_close_sums(got: torch.Tensor, want: torch.Tensor, terms: int) -> None:
    """``torch.testing.assert_close`` with :func:`sum_atol` as the bound (rtol 0: the bound already scales
    with the values)."""
    torch.testing.assert_close(got, want, rtol=0.0, atol=sum_atol(want, terms))
