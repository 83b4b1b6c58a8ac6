"""What the engine thread did during a measured window: step times and contents and the Triton
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
    """Every engine step: when it ended, how long ``step()`` itself ran, and what it carried (tokens,
    sequences, distinct adapters). The gaps between ends also hold the engine's idle waits (nothing to run
    until an adapter lands); the step's own time does not, so the two split a slow stretch into work and wait."""

    def __init__(self, engine) -> None:
        self.steps: list[
            tuple[float, float, int, int, int]
        ] = []  # (end, seconds in step(), tokens, seqs, adapters)
        inner, timed = engine.engine, engine.engine.step
        started = [0.0]

        def step():
            started[0] = time.perf_counter()
            return timed()

        inner.step = step  # this benchmark's engine only: the serving loop calls self.engine.step()

        def listen(stats) -> None:
            end = time.perf_counter()
            self.steps.append((end, end - started[0], stats.num_tokens, stats.num_seqs, stats.num_adapters))

        engine.add_step_listener(listen)

    def window(self, start: float, end: float) -> dict:
        """Steps that ended in [start, end): how many, the gaps between consecutive ones (ms), the steps' own
        times (ms), the time spent in steps and outside them, and the five slowest steps."""
        steps = [s for s in self.steps if start <= s[0] < end]
        gaps = np.diff([s[0] for s in steps]) * 1e3 if len(steps) > 1 else np.zeros(1)
        own = np.array([s[1] for s in steps]) * 1e3 if steps else np.zeros(1)
        slowest = sorted(steps, key=lambda s: -s[1])[:5]
        return {"steps": len(steps), "step_ms_p50": float(np.percentile(gaps, 50)),
                "step_ms_p99": float(np.percentile(gaps, 99)), "step_ms_max": float(gaps.max()),
                "own_ms_p50": float(np.percentile(own, 50)), "own_ms_p99": float(np.percentile(own, 99)),
                "in_steps_s": float(own.sum() / 1e3), "outside_steps_s": float(end - start - own.sum() / 1e3),
                "slowest_steps": [{"ms": round(s[1] * 1e3, 2), "tokens": s[2], "seqs": s[3], "adapters": s[4]}
                                  for s in slowest]}  # fmt: skip
