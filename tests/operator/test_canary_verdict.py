"""The canary verdict alone, on recorded windows: what two pods' `GET /admin/adapters/{name}/split` answered."""

from __future__ import annotations

import math

import pytest

from loraplane.operator.canary import (
    ERROR_RATE_TOO_HIGH,
    INSUFFICIENT_SAMPLES,
    PROMOTE,
    ROLL_BACK,
    STEP_PASSED,
    TTFT_RATIO_TOO_HIGH,
    WAIT,
    Side,
    Thresholds,
    Window,
    decide,
)

LIMITS = Thresholds(min_requests=50, max_error_rate=0.02, max_ttft_ratio=1.5)


def pod(stable: dict, canary: dict, *, stable_version: str = "v1", weight: int = 20) -> dict:
    """One pod's window as the server answers it."""
    return {"name": "chat", "stable": stable_version, "canary": "v2", "weight": weight, "since": 1.0,
            "window_s": 30.0, "versions": {stable_version: stable, "v2": canary}}  # fmt: skip


def side(requests: int, errors: int = 0, ttft: dict | None = None) -> dict:
    return {
        "requests": requests,
        "errors": errors,
        "ttft": ttft if ttft is not None else {"0.05": requests - errors},
    }


def test_too_few_canary_samples_waits_and_says_how_many():
    window = Window.from_pods([pod(side(200), side(20)), pod(side(210), side(25))], "v2")
    decision = decide(window, LIMITS)
    assert (decision.action, decision.reason) == (WAIT, INSUFFICIENT_SAMPLES)
    assert "canary 45" in decision.message and decision.numbers["canaryRequests"] == 45


def test_too_few_stable_samples_waits_too():
    window = Window.from_pods([pod(side(10), side(60))], "v2")
    assert decide(window, LIMITS).action == WAIT


def test_an_empty_window_waits():
    window = Window.from_pods([pod({}, {}), pod(side(0, ttft={}), side(0, ttft={}))], "v2")
    decision = decide(window, LIMITS)
    assert decision.action == WAIT and decision.numbers["errorRate"] is None


def test_errors_past_what_min_requests_allows_roll_back_before_enough_samples():
    # 2% of 50 requests is 1 error: a second one fails the step whatever comes next
    window = Window.from_pods([pod(side(100), side(3, errors=2)), pod(side(100), side(4))], "v2")
    decision = decide(window, LIMITS)
    assert (decision.action, decision.reason) == (ROLL_BACK, ERROR_RATE_TOO_HIGH)


def test_error_rate_over_the_threshold_rolls_back():
    limits = Thresholds(min_requests=50, max_error_rate=0.05, max_ttft_ratio=1.5)
    window = Window.from_pods([pod(side(100), side(40, errors=2)), pod(side(100), side(40, errors=2))], "v2")
    decision = decide(window, limits)
    assert (decision.action, decision.reason) == (ROLL_BACK, ERROR_RATE_TOO_HIGH)
    assert decision.numbers["errorRate"] == 0.05 and decision.numbers["canaryErrors"] == 4
    ok = Window.from_pods([pod(side(100), side(40, errors=2)), pod(side(100), side(40))], "v2")
    assert decide(ok, limits).action == PROMOTE  # 2/80 = 2.5% <= 5%


def test_a_slow_canary_rolls_back_on_the_ttft_ratio():
    fast, slow = {"0.05": 90, "0.1": 10}, {"0.05": 50, "0.2": 50}
    window = Window.from_pods([pod(side(100, ttft=fast), side(100, ttft=slow))], "v2")
    decision = decide(window, LIMITS)
    assert (decision.action, decision.reason) == (ROLL_BACK, TTFT_RATIO_TOO_HIGH)
    assert decision.numbers["canaryTTFTP95"] == 0.2 and decision.numbers["stableTTFTP95"] == 0.1
    assert decision.numbers["ttftRatio"] == 2.0


def test_a_healthy_canary_passes_with_its_numbers():
    window = Window.from_pods([pod(side(300), side(60)), pod(side(280), side(70))], "v2")
    decision = decide(window, LIMITS)
    assert (decision.action, decision.reason) == (PROMOTE, STEP_PASSED)
    assert decision.numbers == {"canaryRequests": 130, "canaryErrors": 0, "canaryTTFTP95": 0.05,
                                "stableRequests": 580, "stableErrors": 0, "stableTTFTP95": 0.05,
                                "errorRate": 0.0, "ttftRatio": 1.0}  # fmt: skip


def test_p95_is_over_every_request_not_an_average_of_pods():
    # pod A: 95 fast canary requests; pod B: 5 very slow ones. Averaging pods' p95s would say ~5 s; over all
    # 100 requests the p95 is the 95th fastest: 0.05 s.
    a = pod(side(100), side(95, ttft={"0.05": 95}))
    b = pod(side(100), side(5, ttft={"10.0": 5}))
    window = Window.from_pods([a, b], "v2")
    assert window.canary.quantile() == 0.05 and window.canary.requests == 100
    assert decide(window, LIMITS).action == PROMOTE
    c = pod(side(100), side(6, ttft={"10.0": 6}))  # one more slow request tips it
    assert Window.from_pods([a, c], "v2").canary.quantile() == 10.0


def test_an_unbounded_ttft_bucket_compares_as_too_slow():
    window = Window.from_pods([pod(side(100), side(100, ttft={"+Inf": 100}))], "v2")
    decision = decide(window, LIMITS)
    assert decision.action == ROLL_BACK and decision.numbers["canaryTTFTP95"] is None
    assert Side.parse({"ttft": {"+Inf": 1}}).quantile() == math.inf


def test_a_pod_already_serving_the_canary_adds_no_stable_samples():
    promoted_pod = pod(side(50), side(50), stable_version="v2")
    window = Window.from_pods([promoted_pod], "v2")
    assert window.stable.requests == 0 and window.canary.requests == 50


@pytest.mark.parametrize("requests", [0, 49])
def test_min_requests_is_a_floor_on_both_sides(requests):
    window = Window.from_pods([pod(side(requests), side(requests))], "v2")
    assert decide(window, LIMITS).action == WAIT
