"""Write status only when it changed, and post one Kubernetes Event per condition transition."""

from __future__ import annotations

import logging

import kopf

from loraplane.operator import conditions as C
from loraplane.operator.context import Context
from loraplane.operator.crd_objects import status_patch
from loraplane.operator.kube import Ref

log = logging.getLogger(__name__)

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
    for cond in C.transitions(old.get("conditions"), status.get("conditions") or []):
        if cond["status"] == C.UNKNOWN:
            continue
        bad = (cond["status"] == C.TRUE) == (cond["type"] in _NEGATIVE)
        message = f"{cond['type']}={cond['status']}: {cond['message']}"
        post_event(body, "Warning" if bad else "Normal", cond["reason"], message)
    return True


def post_event(body: dict, type_: str, reason: str, message: str) -> None:
    try:
        kopf.event(dict(body), type=type_, reason=reason, message=message)
    except Exception:  # outside a running operator (no posting queue): the log still says it
        meta = body.get("metadata") or {}
        log.info("%s/%s %s: %s", meta.get("namespace"), meta.get("name"), reason, message)
