"""A projection's shrink beside its base GEMM: both read only x, so they need not wait for each other.

In a decode step the LoRA kernels are short and latency-bound while the base GEMM streams the weights; run
one after the other, each shrink adds its whole latency to the step. ``shrink_beside`` puts the shrink on a
side stream forked from the current one, runs the base GEMM on the current stream meanwhile, and joins the
two before the expand (which adds into the GEMM's output). Captured into a CUDA graph, the fork and the
join are graph edges: no host work at replay.

The shrink writes only its own buffer (the metadata's ``v``), which the previous layer's expand reads on the
current stream; the fork comes after that expand in stream order, so the side stream never overwrites a
``v`` still being read. x stays alive (the caller holds it) until after the join.

``lora_beside`` goes one step further (``CapturePolicy.expand_beside``): the expand too runs on the side
stream, adding the delta into a zeroed buffer of y's shape instead of into y, and after the join one add
puts the delta on the GEMM's output. The whole LoRA chain then runs beside the GEMM; what stays on the
step's critical path is one elementwise add of y's bytes, where the expand kept a launch chain reading
the adapters' B. The delta is rounded to y's dtype before it is added (delta first does the same).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["beside_stream", "lora_beside", "shrink_beside"]

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


def lora_beside(shrink: Callable[[], None] | None, expand: Callable[[torch.Tensor], None],
                base: Callable[[], None], side: torch.cuda.Stream, y: torch.Tensor) -> None:  # fmt: skip
    """y = base's output + the delta: on ``side``, zero a buffer d of y's shape, ``shrink()``, then
    ``expand(d)`` (the expand adding into d instead of y); meanwhile ``base()`` writes y on the current
    stream; after the join, ``y += d``.

    y: [T, w] (any row stride); d: [T, w] with y's strides (the expand's launch was shaped for y's), made on
    the current stream, which alone uses it after the join, so the allocator may hand it out again there."""
    main = torch.cuda.current_stream(side.device)
    d = y.new_empty_strided(y.shape, y.stride())  # [T, w]
    side.wait_stream(main)  # x written, the previous layer done with v and with its own d
    with torch.cuda.stream(side):
        d.zero_()  # rows without an adapter get no work from the expand: their delta is 0
        if shrink is not None:
            shrink()
        expand(d)
    base()
    main.wait_stream(side)  # the delta complete before it is added
    y.add_(d)
