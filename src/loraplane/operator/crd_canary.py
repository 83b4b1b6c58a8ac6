"""``LoRAAdapter.spec.rollout``'s canary sections (the API, as in crd_models.py; ``status.canary``: crd_objects.py).

A canary rollout sends a growing share of an adapter's requests to the new version, step by step, and moves on
only while the new version's numbers hold against the old one's (operator/canary.py decides).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

from loraplane.operator.crd_base import ApiModel, Rule

DURATION_PATTERN = r"^([0-9]{1,6}(ms|s|m|h)){1,4}$"
_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_STEPS = 20
DEFAULT_PAUSE = "60s"
DEFAULT_MIN_REQUESTS = 50
DEFAULT_MAX_ERROR_RATE = 0.01
DEFAULT_MAX_TTFT_RATIO = 1.5


def seconds_of(text: str) -> float:
    return sum(int(n) * _UNIT_S[unit] for n, unit in _DURATION_PART.findall(text))


Duration = Annotated[str, Field(pattern=DURATION_PATTERN, max_length=32)]


class CanaryStep(ApiModel):
    """One step: send ``weight`` percent of the adapter's requests to the new version, wait ``pause``, analyze."""

    weight: int = Field(ge=1, le=99, description="Percent of requests (by route key) the new version gets.")
    pause: Duration = Field(
        DEFAULT_PAUSE,
        description="How long the step lasts before its analysis, as 30s, 5m, 1h30m or 500ms. "
        "The step then lasts until each version answered analysis.minRequests requests in it.",
    )

    @property
    def pause_s(self) -> float:
        return seconds_of(self.pause)


class CanaryAnalysis(ApiModel):
    """What a step's numbers must hold to pass; the first threshold broken rolls the canary back."""

    min_requests: int = Field(
        DEFAULT_MIN_REQUESTS,
        ge=1,
        le=1_000_000,
        description="Requests each version must have answered in the step before it is judged.",
    )
    max_error_rate: float = Field(
        DEFAULT_MAX_ERROR_RATE,
        ge=0.0,
        le=1.0,
        description="Largest share of the new version's requests the server may fail (0.01: 1%).",
    )
    max_ttft_ratio: float = Field(
        DEFAULT_MAX_TTFT_RATIO,
        alias="maxTTFTRatio",
        ge=0.001,
        le=1000.0,
        description="Largest ratio of the new version's p95 time to first token to the old version's "
        "(1.5: at most 50% slower), over the step's requests on every pod.",
    )


CANARY_STEPS_RULE = Rule(
    "self.strategy != 'Canary' || (has(self.steps) && size(self.steps) > 0)",
    "a Canary rollout needs at least one step",
    lambda r: r.strategy != "Canary" or len(r.steps) > 0,
    ".steps",
)
StepList = Annotated[list[CanaryStep], Field(max_length=MAX_STEPS)]
