"""One Event per status write that changes conditions: its type, the reason it carries, every transition named."""

from __future__ import annotations

from loraplane.operator import conditions as C
from loraplane.operator.publish import _event_of, events_of


def cond(type_: str, status: str, reason: str, message: str = "m") -> dict:
    return C.condition(type_, status, reason, message, 1, "2026-01-01T00:00:00Z")


def test_a_settled_adapter_posts_one_normal_event_with_readys_reason():
    changed = [cond(C.VALIDATED, C.TRUE, C.VALID), cond(C.CACHED, C.TRUE, "Cached"),
               cond(C.READY, C.TRUE, C.ALL_PODS_SERVING, "2/2 pods serve v1"), cond(C.DEGRADED, C.FALSE, C.AS_EXPECTED)]  # fmt: skip
    type_, reason, message = _event_of(changed)
    assert (type_, reason) == ("Normal", C.ALL_PODS_SERVING)
    assert message.startswith("Ready=True: 2/2 pods serve v1; ") and all(
        c["type"] in message for c in changed
    )


def test_a_bad_transition_makes_a_warning_with_the_reason_that_names_the_failure():
    changed = [cond(C.CACHED, C.FALSE, "PodsPending"), cond(C.READY, C.FALSE, C.WARM_FAILED),
               cond(C.DEGRADED, C.TRUE, C.WARM_FAILED, "warm-up failed")]  # fmt: skip
    assert _event_of(changed)[:2] == ("Warning", C.WARM_FAILED)
    only_cached = [cond(C.VALIDATED, C.TRUE, C.VALID), cond(C.CACHED, C.FALSE, "PodsPending")]
    assert _event_of(only_cached)[:2] == ("Warning", "PodsPending")
    assert len(_event_of([cond(C.READY, C.FALSE, "x", "y" * 5000)])[2]) == 1024


def test_a_canary_transition_keeps_an_event_of_its_own():
    changed = [cond(C.READY, C.TRUE, C.ALL_PODS_SERVING), cond(C.CANARY, C.TRUE, "CanaryPromoted"),
               cond(C.DEGRADED, C.FALSE, C.AS_EXPECTED)]  # fmt: skip
    assert [e[:2] for e in events_of(changed)] == [
        ("Normal", "CanaryPromoted"),
        ("Normal", C.ALL_PODS_SERVING),
    ]
    assert [e[1] for e in events_of([cond(C.CANARY, C.TRUE, "CanaryPromoted")])] == ["CanaryPromoted"]
    assert events_of([]) == []
