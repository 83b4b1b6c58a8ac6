"""The canary verdict, pure: from the pods' windows of one step (``GET /admin/adapters/{name}/split`` on each pod),
promote to the next step, wait for more samples, or roll back.

Each pod counts, per version, the requests it finished in the step, the ones it failed, and a histogram of time
to first token (bounds 9% apart). The operator sums the pods' counts per version and merges the histograms, so
the p95 is over every request of the step, not an average of the pods' p95s. The rules, in order:

1. errors: more canary errors than ``maxErrorRate * minRequests`` fails at once (the rate cannot come back
   under the threshold by the time the step has enough samples);
2. samples: fewer than ``minRequests`` requests on either version waits;
3. ``canary errors / canary requests > maxErrorRate`` rolls back;
4. ``canary p95 TTFT / stable p95 TTFT > maxTTFTRatio`` rolls back;
5. otherwise the step passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PROMOTE, WAIT, ROLL_BACK = "Promote", "Wait", "RollBack"
# Condition reasons (CamelCase) of each outcome.
STEP_PASSED, INSUFFICIENT_SAMPLES = "StepPassed", "InsufficientSamples"
ERROR_RATE_TOO_HIGH, TTFT_RATIO_TOO_HIGH = "ErrorRateTooHigh", "TTFTRatioTooHigh"
QUANTILE = 0.95


@dataclass(frozen=True, slots=True)
class Side:
    """One version's counts over a step, summed over the pods."""

    requests: int = 0
    errors: int = 0
    ttft: dict[float, int] = field(default_factory=dict)  # histogram: upper bound (s; inf) -> count

    def __add__(self, other: Side) -> Side:
        merged = dict(self.ttft)
        for bound, count in other.ttft.items():
            merged[bound] = merged.get(bound, 0) + count
        return Side(self.requests + other.requests, self.errors + other.errors, merged)

    @classmethod
    def parse(cls, view: dict | None) -> Side:
        """One version of one pod's window: ``{"requests", "errors", "ttft": {"0.05": 3, "+Inf": 0}}``."""
        view = view or {}
        ttft = {float(bound.replace("+Inf", "inf")): int(n) for bound, n in (view.get("ttft") or {}).items()}
        return cls(int(view.get("requests", 0)), int(view.get("errors", 0)), ttft)

    def quantile(self, q: float = QUANTILE) -> float | None:
        """The upper bound of the bucket holding the q-quantile (None without samples)."""
        total = sum(self.ttft.values())
        if total == 0:
            return None
        seen = 0
        for bound in sorted(self.ttft):
            seen += self.ttft[bound]
            if seen >= q * total:
                return bound
        return math.inf  # unreachable: seen reaches total


@dataclass(frozen=True, slots=True)
class Window:
    """A step's counts on every pod that answered: the canary's and the serving (stable) version's."""

    canary: Side
    stable: Side
    pods: int = 0

    @classmethod
    def from_pods(cls, views: list[dict], canary: str) -> Window:
        """Sum the pods' split views; a pod's stable side is whatever version it serves (the same everywhere
        during a canary)."""
        total_canary, total_stable = Side(), Side()
        for view in views:
            versions = view.get("versions") or {}
            total_canary += Side.parse(versions.get(canary))
            stable = view.get("stable")
            if stable and stable != canary:
                total_stable += Side.parse(versions.get(stable))
        return cls(total_canary, total_stable, len(views))


@dataclass(frozen=True, slots=True)
class Thresholds:
    min_requests: int
    max_error_rate: float
    max_ttft_ratio: float


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # PROMOTE | WAIT | ROLL_BACK
    reason: str  # CamelCase, for the condition and the Event
    message: str
    numbers: dict  # status.canary.analysis (camelCase), without verdict and time


def numbers_of(window: Window) -> dict:
    c, s = window.canary, window.stable
    c95, s95 = c.quantile(), s.quantile()
    ratio = c95 / s95 if c95 is not None and s95 and not math.isinf(c95) and not math.isinf(s95) else None
    return {
        "canaryRequests": c.requests,
        "canaryErrors": c.errors,
        "canaryTTFTP95": _finite(c95),
        "stableRequests": s.requests,
        "stableErrors": s.errors,
        "stableTTFTP95": _finite(s95),
        "errorRate": round(c.errors / c.requests, 6) if c.requests else None,
        "ttftRatio": round(ratio, 4) if ratio is not None else None,
    }


def _finite(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else round(value, 6)


def decide(window: Window, limits: Thresholds) -> Decision:
    """Promote, wait or roll back one step (the rules are the module's docstring)."""
    c, s = window.canary, window.stable
    numbers = numbers_of(window)
    if c.errors > limits.max_error_rate * limits.min_requests:
        return Decision(ROLL_BACK, ERROR_RATE_TOO_HIGH, f"{c.errors} canary errors already exceed "
                        f"maxErrorRate {limits.max_error_rate} of minRequests {limits.min_requests}", numbers)  # fmt: skip
    if c.requests < limits.min_requests or s.requests < limits.min_requests:
        return Decision(WAIT, INSUFFICIENT_SAMPLES, f"canary {c.requests}, stable {s.requests} requests; "
                        f"{limits.min_requests} each needed", numbers)  # fmt: skip
    rate = c.errors / c.requests
    if rate > limits.max_error_rate:
        return Decision(ROLL_BACK, ERROR_RATE_TOO_HIGH, f"canary error rate {rate:.4f} > maxErrorRate "
                        f"{limits.max_error_rate} ({c.errors}/{c.requests})", numbers)  # fmt: skip
    ratio = numbers["ttftRatio"]
    c95, s95 = c.quantile(), s.quantile()
    if c95 is None or s95 is None:  # requests without a first token (all failed or empty): nothing to compare
        return Decision(WAIT, INSUFFICIENT_SAMPLES, "no time-to-first-token samples yet", numbers)
    if ratio is None or ratio > limits.max_ttft_ratio:
        shown = "unbounded" if ratio is None else f"{ratio:.3f}"
        return Decision(ROLL_BACK, TTFT_RATIO_TOO_HIGH, f"p95 TTFT canary {c95:.4f}s / stable {s95:.4f}s = "
                        f"{shown} > maxTTFTRatio {limits.max_ttft_ratio}", numbers)  # fmt: skip
    return Decision(PROMOTE, STEP_PASSED, f"canary {c.requests} requests, error rate {rate:.4f} <= "
                    f"{limits.max_error_rate}; p95 TTFT ratio {ratio:.3f} <= {limits.max_ttft_ratio}", numbers)  # fmt: skip
