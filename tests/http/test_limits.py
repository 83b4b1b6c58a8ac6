"""Per-key limits on their own (a settable clock): reservations at admission, settled when a request ends."""

from __future__ import annotations

import pytest

from loraplane.http.auth import Principal
from loraplane.http.limits import KeyLimits, LimitExceeded

KEY = Principal(0, "budgeted", tokens_per_minute=100)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_request_reserves_its_max_tokens_until_it_ends():
    limits = KeyLimits(Clock())
    first = limits.admit(KEY, 10, 80)  # 90 spoken for: the key is below its limit, one more may start
    second = limits.admit(KEY, 10, 80)
    with pytest.raises(LimitExceeded) as refused:
        limits.admit(KEY, 1, 1)
    assert "reserved" in refused.value.message and refused.value.retry_after_s == 1
    first.add_tokens(5)
    first.release()  # it stopped after 5 of its 80: the other 75 are free again
    second.release()  # it never generated: only its prompt still counts
    limits.admit(KEY, 1, 1).release()


def test_counted_tokens_age_out_after_a_minute():
    clock = Clock()
    limits = KeyLimits(clock)
    ticket = limits.admit(KEY, 50, 50)
    ticket.add_tokens(50)
    ticket.release()
    with pytest.raises(LimitExceeded) as refused:
        limits.admit(KEY, 1, 1)
    assert refused.value.retry_after_s == 60
    clock.now += 60
    limits.admit(KEY, 1, 1).release()
