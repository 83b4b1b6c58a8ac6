"""What the engine thread did during a measured window: step times (from a step listener) and the Triton
kernels compiled (a compile blocks the engine thread for a second or more, which would pass for a stall)."""

from __future__ import annotations

import sys
import time

import numpy as np


class StepClock:
    """Timestamps of every engine step's end (listener on the engine thread)."""

    def __init__(self, engine) -> None:
        self.ends: list[float] = []
        engine.add_step_listener(lambda _stats: self.ends.append(time.perf_counter()))

    def window(self, start: float, end: float) -> dict:
        """Steps that ended in [start, end): how many, and the gaps between consecutive ones (ms)."""
        ends = [t for t in self.ends if start <= t < end]
        gaps = np.diff(ends) * 1e3 if len(ends) > 1 else np.zeros(1)
        return {"steps": len(ends), "step_ms_p50": float(np.percentile(gaps, 50)),
                "step_ms_p99": float(np.percentile(gaps, 99)), "step_ms_max": float(gaps.max())}  # fmt: skip


def triton_compiled() -> int:
    """Kernels Triton has compiled so far in this process, over every JIT function of loraplane."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    seen, total = set(), 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("loraplane") or module is None:
            continue
        for value in vars(module).values():
            fn = getattr(value, "fn", value)  # autotuners / heuristics wrap the JIT function
            if isinstance(fn, JITFunction) and id(fn) not in seen:
                seen.add(id(fn))
                for cache in getattr(fn, "device_caches", {}).values():
                    first = cache[0] if isinstance(cache, tuple) else cache
                    total += len(first) if isinstance(first, dict) else 0
    return total
