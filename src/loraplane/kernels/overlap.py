"""A projection's shrink beside its base GEMM: both read only x, so they need not wait for each other.

In a decode step the LoRA kernels are short and latency-bound while the base GEMM streams the weights; run
one after the other, each shrink adds its whole latency to the step. ``shrink_beside`` puts the shrink on a
side stream forked from the current one, runs the base GEMM on the current stream meanwhile, and joins the
two before the expand (which adds into the GEMM's output). Captured into a CUDA graph, the fork and the
join are graph edges: no host work at replay.

The shrink writes only its own buffer (the metadata's ``v``), which the previous layer's expand reads on the
current stream; the fork comes after that expand in stream order, so the side stream never overwrites a
``v`` still being read. x stays alive (the caller holds it) until after the join.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["beside_stream", "shrink_beside"]

_SIDE: dict[int, torch.cuda.Stream] = {}


def beside_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of ``device`` (one per device, made on first use outside a graph capture); None when
    first asked for inside a capture, where a stream cannot be made: that launch runs on one stream. (The
    engine's graphs run a warm-up step before each capture, which makes it.)"""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE.get(index)
    if stream is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        stream = _SIDE[index] = torch.cuda.Stream(device=index)
    return stream


def shrink_beside(shrink: Callable[[], None] | None, base: Callable[[], None] | None,
                  side: torch.cuda.Stream | None) -> None:  # fmt: skip
    """Run ``shrink`` and ``base`` (either may be None); with ``side``, the shrink on it, in parallel with
    ``base`` on the current stream, joined before returning. Without ``side``: base, then shrink."""
    if side is None or shrink is None or base is None:
        if base is not None:
            base()
        if shrink is not None:
            shrink()
        return
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)  # x written, the previous layer's expand done with v
    with torch.cuda.stream(side):
        shrink()
    base()
    main.wait_stream(side)  # v complete before the expand reads it
