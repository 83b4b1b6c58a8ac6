"""Write status only when it changed, and post one Kubernetes Event per write that changes conditions."""

from __future__ import annotations

from loraplane.operator import conditions as C
from loraplane.operator.context import Context
from loraplane.operator.crd_objects import status_patch
from loraplane.operator.kube import Ref

# Conditions whose True is bad news (their Events are Warnings when True).
_NEGATIVE = frozenset({C.DEGRADED})


def _clean(status: dict) -> dict:
    return {k: v for k, v in status.items() if v is not None}


async def publish(ctx: Context, body: dict, ref: Ref, status: dict) -> bool:
    """Merge-patch ``status`` (None values delete keys) if it differs from the object's. True if written."""
    old = dict(body.get("status") or {})
    status = status_patch(ref.plural, status)  # through the status model: what the schema says
    if "conditions" in status:
        status["conditions"] = C.merge(old.get("conditions"), status["conditions"])
    if _clean(status) == _clean({k: old.get(k) for k in status}):
        return False
    written = await ctx.kube.patch_status(ref, status)
    if written is not None:
        ctx.echo.remember(ref.path(), written)
    changed = [c for c in C.transitions(old.get("conditions"), status.get("conditions") or [])
               if c["status"] != C.UNKNOWN]  # fmt: skip
    for event in events_of(changed):
        post_event(ctx, body, *event)
    return True


def events_of(changed: list[dict]) -> list[tuple[str, str, str]]:
    """The Events of one status write's transitions (Unknown ones left out): one for them all, and one for a
    canary's, whose steps are a story of their own (StepPassed, CanaryPromoted, ...)."""
    canary = [c for c in changed if c["type"] == C.CANARY]
    rest = [c for c in changed if c["type"] != C.CANARY]
    return [_event_of(group) for group in [[c] for c in canary] + ([rest] if rest else [])]


def _bad(cond: dict) -> bool:
    return (cond["status"] == C.TRUE) == (cond["type"] in _NEGATIVE)


# Whose reason an Event carries, first to last: a failure is named best by Degraded's; a success by Ready's.
_LEAD_BAD, _LEAD_GOOD = (C.DEGRADED, C.READY), (C.READY,)


def _event_of(changed: list[dict]) -> tuple[str, str, str]:
    """One Event for the transitions of one status write: (type, reason, message). A Warning when a transition
    is bad, with the reason of the bad one that matters most (Degraded, then Ready, then the first), else
    Normal with Ready's reason (or the first one's); the message names every transition. One per write, not
    one per condition: an adapter that settles at once writes its five conditions together, and at thousands
    of adapters each Event is a write to the API server's store."""
    bad = [c for c in changed if _bad(c)]
    among, order = (bad, _LEAD_BAD) if bad else (changed, _LEAD_GOOD)
    lead = min(among, key=lambda c: order.index(c["type"]) if c["type"] in order else len(order))
    message = "; ".join(
        f"{c['type']}={c['status']}: {c['message']}" for c in [lead, *(c for c in changed if c is not lead)]
    )
    return ("Warning" if bad else "Normal"), lead["reason"], message[:1024]


def post_event(ctx: Context, body: dict, type_: str, reason: str, message: str) -> None:
    """An Event about ``body``, posted in the background through the operator's own API client."""
    ctx.kube.post_event(body, type_, reason, message)
