"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel
ahead of it in the stream (or graph) drains, so its launch latency, and any work that needs nothing from
that kernel, hide under the other's tail.

A kernel compiled with ``GDC`` waits (``griddepcontrol.wait``) before it reads or writes anything the kernel
ahead produces or consumes. Every program must reach that wait, work or none: a kernel then finishes only
after the one ahead of it has, and the order holds along a chain of such launches. The launcher asks for it
with ``pdl_option``; where it is not available (``pdl_available``: the CPU interpreter, an older GPU, a
Triton without grid dependency control) the kernel is compiled without the wait and launched as usual.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None

__all__ = ["launch_dependents", "pdl_available", "pdl_option", "wait_for_kernel_ahead"]


@triton.jit
def wait_for_kernel_ahead(GDC: tl.constexpr):
    """Under programmatic dependent launch (GDC): block until the kernel ahead has finished and its writes
    are visible. Without GDC: nothing."""
    if GDC:
        gdc_wait()


@triton.jit
def launch_dependents(GDC: tl.constexpr):
    """Under GDC: the kernel after this one may start its programs (they wait for ours to finish)."""
    if GDC:
        gdc_launch_dependents()


def pdl_available(t: torch.Tensor) -> bool:
    """Programmatic dependent launch is there for kernels on ``t``'s device: a CUDA device of compute
    capability 9.0 or later, a Triton with grid dependency control and its ``launch_pdl`` option, and not
    Triton's interpreter."""
    if not t.is_cuda or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False  # the interpreter runs no inline assembly, so no griddepcontrol
    return _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.cache
def _pdl_device(device: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    has_option = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
    return has_option and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_option(on: bool) -> dict:
    """Triton's launch option for a kernel compiled with GDC (``on``)."""
    return {"launch_pdl": True} if on else {}
