"""Helpers that let a pool touch every layer's rows with one kernel and the device tables without a sync.

A pool keeps one weight tensor per (layer, module), as the kernels read them. When a module's per-layer
tensors sit evenly spaced in one storage (a pool's own buffers, or the unified memory's stacked arenas),
``stack_layers`` returns the [L, ...] view over all of them, so zeroing or placing an adapter's rows is one
``index_fill_``/``index_copy_`` along the row dim instead of one per layer.
"""

from __future__ import annotations

import torch

__all__ = ["stack_layers", "to_device"]


def stack_layers(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The [L, *shape] strided view whose [l] is ``tensors[l]``, or None when they are not evenly spaced
    in one storage with one shape and strides (then callers loop over the layers)."""
    t0 = tensors[0]
    if any(t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype for t in tensors):
        return None
    if any(t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() for t in tensors):
        return None
    offsets = [t.storage_offset() for t in tensors]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    if any(b - a != step for a, b in zip(offsets, offsets[1:], strict=False)):
        return None
    return t0.as_strided((len(tensors), *t0.shape), (step, *t0.stride()), t0.storage_offset())


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the device: on CUDA the list goes through a
    page-locked buffer (torch's caching host allocator keeps it until the copy has run), so the copy is
    queued on the current stream instead of synchronising it as a copy from pageable memory does."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
