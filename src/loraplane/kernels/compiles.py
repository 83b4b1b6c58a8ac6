"""How many kernels Triton has compiled in this process: benchmarks report it per window, and tests check
that steps after the engine's warm-up compile nothing."""

from __future__ import annotations

import sys


def triton_compiled() -> int:
    """Kernels Triton has compiled so far in this process, over every JIT function of loraplane (0 without
    Triton)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    seen, total = set(), 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("loraplane") or module is None:
            continue
        for value in vars(module).values():
            fn = jit_function(value, JITFunction)
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                for cache in getattr(fn, "device_caches", {}).values():
                    first = cache[0] if isinstance(cache, tuple) else cache  # (kernel cache, ...) per device
                    total += len(first) if isinstance(first, dict) else 0
    return total


def jit_function(value, jit_type: type):
    """The JIT function that ``value`` is or wraps, else None. Autotuners and heuristics hold it as ``fn``;
    a JIT function's own ``fn`` is its Python source function, so the walk stops at the first JIT function."""
    for _ in range(4):  # a few wrappers deep at most (autotune over heuristics over jit)
        if isinstance(value, jit_type):
            return value
        value = getattr(value, "fn", None)
        if value is None:
            return None
    return None
