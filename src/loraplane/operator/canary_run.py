"""Acting on a canary rollout (``spec.rollout.strategy: Canary``), one pass at a time.

Load the new version beside the serving one on every pod; set the step's traffic split on every pod; once the
step's pause is over, judge the pods' windows (canary.py decides); then go to the next step, promote (switch every
pod to the new version and drop the splits: the usual clean-up then unloads the old version) or roll back (drop
the splits, unload the new version everywhere; it is not tried again until the spec changes). Where the canary
stands lives in ``status.canary`` (step, when it began, the last numbers) and the ``Canary`` condition, so a
restarted operator resumes at the recorded step, and every decision is an Event.
"""

from __future__ import annotations

import datetime

from loraplane.operator import canary as V
from loraplane.operator import conditions as C
from loraplane.operator import rollout as R
from loraplane.operator.adapter_verdict import Verdict, summarize
from loraplane.operator.admin_client import AdminError, LoadRequest
from loraplane.operator.context import Context
from loraplane.operator.crd_models import AdapterSpec
from loraplane.operator.pod_ops import act, each, load_in_batches, observe, touched
from loraplane.operator.publish import post_event


class Pass:
    """One canary pass: what it saw and did, and what status will say."""

    def __init__(
        self, ctx: Context, adapter: dict, spec: AdapterSpec, target: R.Target, token: str, desired: int
    ):
        self.ctx, self.adapter, self.spec, self.target, self.token = ctx, adapter, spec, target, token
        self.desired, self.name = desired, target.name
        self.status = adapter.get("status") or {}
        self.generation = adapter["metadata"].get("generation", 0)
        self.failure: tuple[str, str] | None = None

    def fresh_record(self) -> dict:
        return {"version": self.target.version, "digest": self.target.digest, "step": 0,
                "steps": len(self.spec.rollout.steps), "weight": 0, "observedGeneration": self.generation}  # fmt: skip

    def event(self, type_: str, reason: str, message: str) -> None:
        post_event(self.ctx, self.adapter, type_, reason, f"{self.target.version}: {message}")

    async def split_all(self, views, weight: int) -> dict[str, AdminError]:
        version = self.target.version
        return await act(self.ctx, views, lambda v: self.ctx.admin.set_split(v.address, self.token, self.name,
                                                                              version, weight))  # fmt: skip

    async def drop_splits(self, views) -> None:
        await act(self.ctx, views, lambda v: self.ctx.admin.drop_split(v.address, self.token, self.name))


async def run(ctx: Context, adapter: dict, spec: AdapterSpec, views: list[R.PodView], target: R.Target,
              request: LoadRequest, token: str, verdict: Verdict, desired: int) -> list[R.PodView] | None:  # fmt: skip
    """The canary's part of a pass: the pods' views once handled, or None when the usual switch path goes on
    (a first version, which has nothing to be compared with, or a canary that was promoted)."""
    p = Pass(ctx, adapter, spec, target, token, desired)
    record = p.status.get("canary") or {}
    if (record.get("version"), record.get("digest")) != (target.version, target.digest):
        record = {}
    outcome = (C.get(p.status.get("conditions"), C.CANARY) or {}) if record else {}
    if outcome.get("status") == C.TRUE:
        verdict.set(C.CANARY, C.TRUE, C.CANARY_PROMOTED, outcome.get("message", ""))
        verdict.fields["canary"] = record
        return None
    if outcome.get("status") == C.FALSE and record.get("observedGeneration") == p.generation:
        return await _stay_rolled_back(p, views, verdict, record, outcome)
    if not any(R.old_serving(v, target) for v in views):
        return None  # nothing serves another version: the first version of a name serves at once
    record = dict(record) if record and outcome.get("status") != C.FALSE else p.fresh_record()
    views = await _step(p, views, request, record, verdict)
    verdict.fields["canary"] = record
    if views is None:
        return None
    touched(ctx, views)
    fresh = await observe(ctx, [v.address for v in views], token, target.name)
    summarize(verdict, fresh, target, desired, {}, True)
    if p.failure is not None:
        verdict.fail(*p.failure)
    return fresh


async def _step(p: Pass, views, request: LoadRequest, record: dict, verdict: Verdict):
    """Load, split, wait, judge; returns the views (handled) or None (promoted: the switch path cleans up)."""
    ctx, target, steps = p.ctx, p.target, p.spec.rollout.steps
    empty = [v for v in views if v.reachable and v.serving(target.name) is None]
    if empty:  # a restarted pod: the serving version first, or it would serve the canary to everyone
        await _restore(p, empty)
        return _wait(p, verdict, C.CANARY_LOADING, f"restoring the serving version on {_names(empty)}", views)
    errors, pending, _ = await load_in_batches(
        p.ctx, views, p.target, p.spec.max_unavailable, p.token, request
    )
    if errors:
        first = next(iter(errors.values()))
        return await _roll_back(p, views, verdict, record, first.reason, f"{first.pod}: {first.message}")
    if pending or not all(v.reachable for v in views):
        return _wait(
            p, verdict, C.CANARY_LOADING, f"loading beside the serving version ({len(views)} pods)", views
        )
    if record["step"] == 0:
        record.update(step=1, stepStartTime=C.now())
    index, now = record["step"], C.now()
    step = steps[min(index, len(steps)) - 1]
    record["weight"] = step.weight
    failed = await p.split_all(views, step.weight)
    where = f"step {index}/{len(steps)} at {step.weight}%"
    if failed:
        first = next(iter(failed.values()))
        p.failure = (first.reason, f"{where}: setting the split on {first.pod}: {first.message}")
        return _wait(p, verdict, first.reason, p.failure[1], views)
    left = step.pause_s - _age(record.get("stepStartTime"), now)
    if left > 0:
        return _wait(p, verdict, C.CANARY_PAUSED, f"{where}: {left:.0f}s of {step.pause} left", views)
    windows = await each(ctx, views, lambda v: _window(p, v))
    broken = [w for w in windows if isinstance(w, AdminError)]
    if broken:
        p.failure = (broken[0].reason, f"{where}: reading {broken[0].pod}'s window: {broken[0].message}")
        return _wait(p, verdict, broken[0].reason, p.failure[1], views)
    a = p.spec.rollout.analysis
    decision = V.decide(V.Window.from_pods([w for w in windows if w], target.version),
                        V.Thresholds(a.min_requests, a.max_error_rate, a.max_ttft_ratio))  # fmt: skip
    record["analysis"] = {**decision.numbers, "verdict": decision.action, "time": now}
    text = f"{where}: {decision.message}"
    if decision.action == V.WAIT:
        return _wait(p, verdict, decision.reason, text, views)
    if decision.action == V.ROLL_BACK:
        return await _roll_back(p, views, verdict, record, decision.reason, text)
    p.event("Normal", V.STEP_PASSED, text)
    if index < len(steps):
        record.update(step=index + 1, stepStartTime=now, weight=steps[index].weight)
        await p.split_all(views, steps[index].weight)  # the next window starts now (a failure: next pass)
        return _wait(p, verdict, V.STEP_PASSED, text, views)
    return await _promote(p, views, verdict, record, text)


async def _promote(p: Pass, views, verdict: Verdict, record: dict, text: str):
    ctx, target = p.ctx, p.target
    errors = await act(
        ctx, views, lambda v: ctx.admin.switch(v.address, p.token, target.name, target.version)
    )
    if errors:  # the next pass judges the last step again and retries the switch
        first = next(iter(errors.values()))
        p.failure = (first.reason, f"promoting: {first.pod}: {first.message}")
        return _wait(p, verdict, first.reason, p.failure[1], views)
    await p.drop_splits(views)
    touched(ctx, views)
    record["weight"] = 100
    message = f"every step passed; {target.version} serves every request ({text})"
    verdict.set(C.CANARY, C.TRUE, C.CANARY_PROMOTED, message)  # its transition is the Event
    return None


async def _roll_back(p: Pass, views, verdict: Verdict, record: dict, reason: str, text: str):
    """Every request back to the serving version, the canary unloaded everywhere; sticky until the spec changes."""
    await p.drop_splits([v for v in views if v.reachable])
    await _undo(p, views)
    record.update(weight=0, observedGeneration=p.generation)
    message = f"rolled back: {text}"
    verdict.set(C.CANARY, C.FALSE, reason, message)
    p.failure = (reason, f"{p.target.version} {message}; the serving version keeps every request")
    p.event("Warning", C.CANARY_ROLLED_BACK, message)
    return views


async def _stay_rolled_back(p: Pass, views, verdict: Verdict, record: dict, outcome: dict):
    """A rolled-back canary stays out: restarted pods get the serving version, stray copies go."""
    empty = [v for v in views if v.reachable and v.serving(p.name) is None]
    if empty:
        await _restore(p, empty)
    if any(v.target(p.target) for v in views):
        await p.drop_splits([v for v in views if v.reachable])
        await _undo(p, views)
    touched(p.ctx, views)
    fresh = await observe(p.ctx, [v.address for v in views], p.token, p.name)
    summarize(verdict, fresh, p.target, p.desired, {}, False)
    reason, message = outcome.get("reason") or C.CANARY_ROLLED_BACK, outcome.get("message", "")
    verdict.set(C.CANARY, C.FALSE, reason, message)
    verdict.fail(reason, f"{p.target.version} {message}; change the spec to try again")
    verdict.fields["canary"] = record
    return fresh


async def _undo(p: Pass, views) -> None:
    """rollout.py's rollback plan on what the pods hold now: the canary unloaded wherever it does not serve alone."""
    fresh = await observe(p.ctx, [v.address for v in views], p.token, p.name)
    plan = {u.pod.name: u for u in R.rollback_plan(fresh, p.target)}
    await act(p.ctx, [u.pod for u in plan.values()], lambda v: _apply_undo(p, plan[v.name]))


async def _apply_undo(p: Pass, undo: R.Undo) -> None:
    if undo.switch_to:
        await p.ctx.admin.switch(undo.pod.address, p.token, p.name, undo.switch_to)
    if undo.unload_target:
        await p.ctx.admin.unload(undo.pod.address, p.token, p.name, p.target.version)


async def _restore(p: Pass, empty) -> None:
    """Load the version status says serves (validated when it rolled out; each pod verifies its digest)."""
    version, digest, uri = (p.status.get(k) for k in ("servingVersion", "digest", "servingSource"))
    if not (version and digest and uri) or version == p.target.version:
        return
    request = LoadRequest(uri, version, digest, p.spec.pin, p.spec.warm)
    await act(p.ctx, empty, lambda v: p.ctx.admin.load(v.address, p.token, p.name, request))


async def _window(p: Pass, view: R.PodView):
    try:
        return await p.ctx.admin.split(view.address, p.token, p.name)
    except AdminError as exc:
        return exc


def _wait(p: Pass, verdict: Verdict, reason: str, message: str, views):
    verdict.set(C.CANARY, C.UNKNOWN, reason, message)
    return views


def _names(views) -> str:
    return ", ".join(v.name for v in views)


def _age(since: str | None, now: str) -> float:
    def parse(text: str) -> datetime.datetime:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)

    try:
        return (parse(now) - parse(since)).total_seconds() if since else 0.0
    except ValueError:
        return 0.0
