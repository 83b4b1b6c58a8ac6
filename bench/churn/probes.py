"""What the engine thread did during a measured window: step times (from a step listener) and the Triton
kernels compiled (a compile blocks the engine thread for a second or more, which would pass for a stall)."""

from __future__ import annotations

import time

import numpy as np

from loraplane.kernels.compiles import triton_compiled  # noqa: F401 - re-exported for the bench modules
from loraplane.kernels.fast_launch import launch_counts


def launches_since(before: dict[str, int]) -> dict[str, int]:
    """LoRA kernel launches since ``before`` (``launch_counts()``): ``direct`` through the recorded
    launcher, ``triton`` through Triton's per-call binding (tens of microseconds of host time each)."""
    return {k: v - before.get(k, 0) for k, v in launch_counts().items()}


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
