"""What one LoRAAdapter pass concludes, decided from what it saw: no I/O here.

``summarize`` turns the pods' views into the Verdict's conditions; ``status_of`` turns a Verdict into the status
that reconcile_adapter writes; ``converged`` says whether a pod set needs nothing more for a target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplane.operator import conditions as C
from loraplane.operator import rollout as R


@dataclass(slots=True)
class Verdict:
    """What one pass concluded: condition type -> (status, reason, message), and when to come back."""

    conditions: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)
    failed: bool = False
    pending: bool = False
    rolled_back: list = field(default_factory=list)  # pods switched back or cleaned after a failure
    token: str = field(default="", repr=False)  # the admin token used (a quiet drift check reuses it)

    def set(self, type_: str, status: str, reason: str, message: str) -> None:
        self.conditions[type_] = (status, reason, message)

    def fail(self, reason: str, message: str, *, validated: str | None = None) -> None:
        self.failed = True
        if validated is not None:
            self.set(C.VALIDATED, validated, reason, message)
        self.set(C.READY, C.FALSE, reason, message)
        self.set(C.DEGRADED, C.TRUE, reason, message)


def converged(views: list[R.PodView], target: R.Target) -> bool:
    return all(
        v.reachable
        and not R.needs_load(v, target)
        and not R.needs_switch(v, target)
        and not R.needs_cleanup(v, target)
        for v in views
    )


def summarize(verdict: Verdict, views, target: R.Target, desired: int, errors: dict, pending: bool) -> None:
    serving = sum(1 for v in views if v.reachable and not R.needs_switch(v, target))
    warm = sum(1 for v in views if v.reachable and not R.needs_load(v, target))
    verdict.fields["readyPods"] = serving
    unreachable = [v for v in views if not v.reachable]
    if R.cached_everywhere(views, target, desired):
        verdict.set(
            C.CACHED, C.TRUE, C.ALL_CACHED, f"{desired} pods hold {target.version} in their host cache"
        )
    else:
        verdict.set(C.CACHED, C.FALSE, C.PODS_PENDING, "some pods have not cached the version yet")
    if warm >= desired:
        verdict.set(C.WARMED, C.TRUE, C.ALL_WARMED, f"{warm}/{desired} pods warmed {target.version}")
    else:
        verdict.set(C.WARMED, C.FALSE, C.PODS_PENDING, f"{warm}/{desired} pods warmed {target.version}")
    failures = list(errors.values()) + [v.error for v in unreachable if v.error]
    if failures:
        first = failures[0]
        rolled = any(R.old_serving(v, target) for v in views)
        message = f"{first.pod}: {first.message}" + (
            "; rolled back, the old version serves" if rolled else ""
        )
        verdict.fail(first.reason, message)
        return
    verdict.set(C.DEGRADED, C.FALSE, C.AS_EXPECTED, "no failure")
    if serving >= desired:
        verdict.set(C.READY, C.TRUE, C.ALL_PODS_SERVING, f"{serving}/{desired} pods serve {target.version}")
    else:
        reason = C.ROLLING_OUT if any(R.old_serving(v, target) for v in views) else C.PODS_PENDING
        verdict.set(C.READY, C.FALSE, reason, f"{serving}/{desired} pods serve {target.version}")
        verdict.pending = True
    verdict.pending = verdict.pending or pending


def status_of(adapter: dict, verdict: Verdict, views: list, now: str) -> dict:
    generation = adapter["metadata"].get("generation", 0)
    old = adapter.get("status") or {}
    previous_rows = {row.get("name"): row for row in old.get("pods") or []}
    status = {"observedGeneration": generation, **verdict.fields}
    if views:
        meta, spec = adapter["metadata"], adapter.get("spec") or {}
        target = R.Target(meta["name"], spec.get("version", ""), verdict.fields.get("validatedDigest", ""))
        status["pods"] = [R.pod_row(v, target, previous_rows.get(v.name), now) for v in views]
        serving = R.serving_version(views, meta["name"])
        status["servingVersion"] = serving.version if serving else None
        status["digest"] = serving.digest if serving else None
        if serving is not None and target.matches(serving):  # the source of what serves, for restore()
            status["servingSource"] = (spec.get("source") or {}).get("uri")
    conds = []
    types = C.ADAPTER_CONDITIONS + ((C.CANARY,) if C.CANARY in verdict.conditions else ())
    for type_ in types:
        state, reason, message = verdict.conditions.get(type_, (C.UNKNOWN, C.RECONCILING, "not evaluated"))
        conds.append(C.condition(type_, state, reason, message, generation, now))
    status["conditions"] = conds
    return status


def spec_version(adapter: dict) -> str:
    return str((adapter.get("spec") or {}).get("version", ""))


def metric_state(verdict: Verdict) -> str:
    if verdict.conditions.get(C.VALIDATED, ("",))[0] == C.FALSE:
        return "Invalid"
    if verdict.conditions.get(C.DEGRADED, ("",))[0] == C.TRUE:
        return "Degraded"
    return "Ready" if verdict.conditions.get(C.READY, ("",))[0] == C.TRUE else "Progressing"
