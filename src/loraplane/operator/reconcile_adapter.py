"""Reconcile one LoRAAdapter: validate, then bring every ready pod of its base to the version (the acting part;
adapter_verdict.py decides what a pass concluded).

One pass reads everything it decides on from the API (via kopf's indexes) and the pods (GET
/admin/adapters), acts (rollout.py says what), re-reads the pods, and writes status once. It returns
how long to sleep before the next pass; pod and base events wake it earlier.
"""

from __future__ import annotations

from loraplane.operator import canary_run, metrics, placement, routing
from loraplane.operator import conditions as C
from loraplane.operator import rollout as R
from loraplane.operator.adapter_verdict import (
    Verdict,
    converged,
    metric_state,
    spec_version,
    status_of,
    summarize,
)
from loraplane.operator.admin_client import AdminError, LoadRequest, PodAddress
from loraplane.operator.builders import admin_token_key, admin_token_secret_name
from loraplane.operator.context import Context
from loraplane.operator.crd_models import ADAPTER_PLURAL, AdapterSpec, BaseSpec, SpecError
from loraplane.operator.crd_objects import LoRAAdapter
from loraplane.operator.kube import custom_ref
from loraplane.operator.pod_ops import act, load_in_batches, observe, settled, touched
from loraplane.operator.publish import post_event, publish
from loraplane.operator.validation import (
    ValidationFailed,
    check_base_policy,
    check_identity,
    check_not_older,
    labeled_secret,
    validate,
)


async def admin_token(ctx: Context, namespace: str, base: dict, spec: BaseSpec) -> str:
    name = admin_token_secret_name(base, spec)
    if spec.admin_token is not None:  # named by the LoRABase: only if labeled for the operator
        data = await labeled_secret(ctx, namespace, name, "spec.adminTokenSecretRef.name")
    else:  # the operator's own
        data = await ctx.kube.secret_data(namespace, name)
    token = (data or {}).get(admin_token_key(spec))
    if not token:
        raise ValidationFailed(
            C.SECRET_NOT_FOUND, "the admin token Secret of the base is missing", transient=True
        )
    return token


async def converge(
    ctx, views, target, request, max_unavailable, token
) -> tuple[dict[str, AdminError], bool, list]:
    """Load, switch, clean up (rollout.py). Returns (errors by pod, still pending, pods rolled back)."""
    name = target.name
    errors, pending, views = await load_in_batches(ctx, views, target, max_unavailable, token, request)
    if not errors and not pending and all(v.reachable for v in views):
        switch = [v for v in views if R.needs_switch(v, target)]
        errors = await act(ctx, switch, lambda v: ctx.admin.switch(v.address, token, name, target.version))
        if not errors:
            cleanup = [(v, old) for v in views for old in R.needs_cleanup(v, target)]
            await act(ctx, cleanup, lambda vo: ctx.admin.unload(vo[0].address, token, name, vo[1].version))
    if errors:
        fresh = await observe(ctx, [v.address for v in views], token, name)
        undo = R.rollback_plan(fresh, target)
        await act(ctx, undo, lambda u: _undo(ctx, u, token, target))
        return errors, pending, [u.pod.name for u in undo]
    return errors, pending, []


async def _undo(ctx: Context, undo: R.Undo, token: str, target: R.Target) -> None:
    if undo.switch_to:
        await ctx.admin.switch(undo.pod.address, token, target.name, undo.switch_to)
    if undo.unload_target:
        await ctx.admin.unload(undo.pod.address, token, target.name, target.version)


async def restore(ctx: Context, adapter: dict, spec: AdapterSpec, pods, token: str) -> list[R.PodView]:
    """While spec's version cannot be validated, pods that serve nothing (restarted, new) get the version
    status says was serving. It was validated when it rolled out, and each pod verifies it again against
    the pinned digest; without this, a bad new version would empty restarted pods."""
    old = adapter.get("status") or {}
    version, digest, uri = old.get("servingVersion"), old.get("digest"), old.get("servingSource")
    name = adapter["metadata"]["name"]
    if not (version and digest and uri and pods):
        return []
    views = await observe(ctx, pods, token, name, shared=True)
    empty = [v for v in views if v.reachable and v.serving(name) is None]
    if not empty:
        return views
    request = LoadRequest(uri, version, digest, spec.pin, spec.warm)
    await act(ctx, empty, lambda v: ctx.admin.load(v.address, token, name, request))
    views = await observe(ctx, pods, token, name)
    settled(ctx, views, name)
    return views


async def run_pass(
    ctx: Context, adapter: dict, base: dict | None, pods: list[PodAddress]
) -> tuple[Verdict, list]:
    verdict, views = Verdict(), []
    meta = adapter["metadata"]
    namespace = meta["namespace"]
    try:
        spec = LoRAAdapter.parse(adapter).spec  # its name too: it goes into URLs and metric labels
    except SpecError as exc:
        verdict.fail("InvalidSpec", str(exc), validated=C.FALSE)
        return verdict, views
    if base is None:
        verdict.set(C.VALIDATED, C.UNKNOWN, C.BASE_NOT_FOUND, f"no LoRABase {spec.base!r} in {namespace}")
        verdict.fail(C.BASE_NOT_FOUND, f"no LoRABase {spec.base!r} in {namespace}")
        verdict.failed = False  # nothing to retry: the base's creation wakes this adapter
        return verdict, views
    try:
        base_spec = BaseSpec.parse(base.get("spec") or {})
        await check_base_policy(ctx, namespace, base, base_spec)  # its endpoint and Secrets are used below
        token = verdict.token = await admin_token(ctx, namespace, base, base_spec)
    except SpecError as exc:
        verdict.fail(C.BASE_NOT_READY, f"the LoRABase is invalid: {exc}", validated=C.UNKNOWN)
        return verdict, views
    except ValidationFailed as exc:
        verdict.fail(exc.reason, exc.message, validated=C.UNKNOWN)
        return verdict, views
    try:
        verified = await validate(ctx, namespace, base_spec, spec)
        check_identity(meta["name"], spec.version, verified)
        await check_not_older(ctx, namespace, base_spec, spec, adapter.get("status") or {}, verified)
    except ValidationFailed as exc:
        verdict.fail(exc.reason, exc.message, validated=C.UNKNOWN if exc.transient else C.FALSE)
        return verdict, await restore(ctx, adapter, spec, pods, token)
    rank = max(verified.manifest.ranks.values(), default=0)
    desired = spec.placement.pods(base_spec.replicas)
    verdict.fields.update(validatedDigest=verified.digest, rank=rank, desiredPods=desired)
    verdict.set(C.VALIDATED, C.TRUE, C.VALID, f"signed by {verified.key_id}, {verified.digest}, rank {rank}")
    await name_in_pool(ctx, adapter, spec.base)
    if not pods:
        state, reason = (C.FALSE, C.BASE_NOT_READY) if base_spec.replicas else (C.TRUE, C.ALL_PODS_SERVING)
        for type_ in (C.CACHED, C.WARMED, C.READY):
            verdict.set(type_, state, reason, f"no ready pod of the base; {base_spec.replicas} desired")
        verdict.fields.update(readyPods=0, pods=[])
        verdict.set(C.DEGRADED, C.FALSE, C.AS_EXPECTED, "no failure")
        return verdict, views
    target = R.Target(meta["name"], spec.version, verified.digest)
    request = LoadRequest(spec.uri, spec.version, verified.digest, spec.pin, spec.warm)
    pods, elsewhere = place(meta["name"], spec, pods)
    await release(ctx, elsewhere, token, target.name)
    views = await observe(ctx, pods, token, target.name, shared=True)
    if any(v.error is not None and v.error.reason == C.TOKEN_REFUSED for v in views):
        ctx.kube.forget_secret(namespace, admin_token_secret_name(base, base_spec))  # rotated: read it again
    if spec.canary:
        handled = await canary_run.run(ctx, adapter, spec, views, target, request, token, verdict, desired)
        if handled is not None:
            return verdict, handled
        views = await observe(ctx, pods, token, target.name)
    elif (adapter.get("status") or {}).get("canary"):
        verdict.fields["canary"] = None  # the strategy is Switch now: no canary to show
    if converged(views, target):  # the common case, a drift check that finds nothing to do
        errors, pending = {}, False
    else:
        views = await observe(ctx, pods, token, target.name)  # act only on what the pods say now
        errors, pending, verdict.rolled_back = await converge(
            ctx, views, target, request, spec.max_unavailable, token
        )
        views = await observe(ctx, pods, token, target.name)
        settled(ctx, views, target.name)
    views = [R.PodView(v.address, v.loaded, errors.get(v.name) or v.error) for v in views]
    summarize(verdict, views, target, desired, errors, pending)
    return verdict, views


def place(name: str, spec: AdapterSpec, pods: list[PodAddress]) -> tuple[list[PodAddress], list[PodAddress]]:
    """(the ready pods that load the adapter, the others)."""
    chosen = placement.choose(name, pods, spec.placement.pods(len(pods)))
    return chosen, [p for p in pods if p not in chosen]


async def release(ctx: Context, pods: list[PodAddress], token: str, name: str) -> None:
    """Unload the adapter from pods it is not placed on (after its placement shrank, or pods came)."""
    holding = [v.address for v in await observe(ctx, pods, token, name, shared=True) if v.of(name)]
    if holding:
        await act(ctx, holding, lambda p: ctx.admin.unload(p, token, name))
        touched(ctx, holding)


async def name_in_pool(ctx: Context, adapter: dict, base_name: str) -> None:
    """A validated adapter's model name in its base's InferencePool, where the API serves that kind."""
    if ctx.routing and await ctx.kube.serves(routing.REWRITE_VERSION, routing.REWRITE_PLURAL):
        await ctx.kube.apply(routing.build_model_rewrite(adapter, base_name), adopt=False)


async def reconcile(ctx: Context, adapter: dict, base: dict | None, pods: list[PodAddress]) -> float:
    """One pass; returns the seconds until the next one."""
    meta = adapter["metadata"]
    ref = custom_ref(ADAPTER_PLURAL, meta["namespace"], meta["name"])
    if await _still_quiet(ctx, ref.path(), _reads(adapter, base, pods), meta["name"]):
        metrics.QUIET_CHECKS.inc()
        return ctx.backoff((meta["uid"], meta.get("generation")), False)
    with metrics.reconcile_timer("LoRAAdapter") as outcome:
        if not (adapter.get("status") or {}).get("conditions"):  # first visit: everything Unknown
            first = {"conditions": C.initial(C.ADAPTER_CONDITIONS, meta.get("generation", 0))}
            await publish(ctx, adapter, ref, first)
            adapter = {**adapter, "status": first}
        verdict, views = await run_pass(ctx, adapter, base, pods)
        await publish(ctx, adapter, ref, status_of(adapter, verdict, views, C.now()))
        if verdict.rolled_back:
            message = f"{spec_version(adapter)} failed; rolled back on {', '.join(verdict.rolled_back)}"
            post_event(ctx, adapter, "Warning", C.ROLLED_BACK, message)
        metrics.set_adapter_state(meta["namespace"], meta["name"], metric_state(verdict),
                                  verdict.fields.get("readyPods", 0))  # fmt: skip
        outcome["result"] = "retry" if verdict.failed else "ok"
    if _settled(adapter, verdict, views):
        # as of our own status write, if the pass made one: the next pass reads that resourceVersion
        reads = _reads(ctx.echo.newest(ref.path(), adapter), base, pods)
        ctx.quiet.remember(ref.path(), reads, (verdict.token, [(v.address, v.loaded) for v in views]))
    else:
        ctx.quiet.forget(ref.path())
    delay = ctx.backoff((meta["uid"], meta.get("generation")), verdict.failed)
    return min(delay, ctx.tunables.poll_interval) if verdict.pending and not verdict.failed else delay


def _reads(adapter: dict, base: dict | None, pods: list[PodAddress]) -> tuple:
    """What a pass decides on besides the pods' listings: the adapter (spec and status), its base, its pods."""
    base_version = ((base or {}).get("metadata") or {}).get("resourceVersion")
    return adapter["metadata"].get("resourceVersion"), base_version, tuple(pods)


def _settled(adapter: dict, verdict: Verdict, views: list[R.PodView]) -> bool:
    """A pass that found nothing to do and nothing wrong, outside a canary (whose steps run on a clock)."""
    rollout = (adapter.get("spec") or {}).get("rollout") or {}
    return (not verdict.failed and not verdict.pending and not verdict.rolled_back and bool(verdict.token)
            and all(v.reachable and v.error is None for v in views) and rollout.get("strategy") != "Canary"
            and not (adapter.get("status") or {}).get("canary"))  # fmt: skip


async def _still_quiet(ctx: Context, path: str, reads: tuple, name: str) -> bool:
    """A drift check of a settled adapter whose object, base and pods are as its last pass read them: the pods
    (their shared listings, one GET per pod however many adapters ask) still hold what that pass saw."""
    seen = ctx.quiet.seen(path, reads)
    if seen is None:
        return False
    token, before = seen
    views = await observe(ctx, [address for address, _ in before], token, name, shared=True)
    return [(v.address, v.loaded) for v in views] == before


async def finalize(
    ctx: Context, adapter: dict, base: dict | None, pods: list[PodAddress]
) -> list[AdminError]:
    """Unload the adapter (every version) from every pod; the failures that must hold the finalizer."""
    meta = adapter["metadata"]
    if base is None or not pods:
        return []
    try:
        token = await admin_token(ctx, meta["namespace"], base, BaseSpec.parse(base.get("spec") or {}))
    except (ValidationFailed, SpecError):
        return []  # the base is going away: its pods (and their adapters) with it
    errors = await act(ctx, pods, lambda p: ctx.admin.unload(p, token, meta["name"]))
    touched(ctx, [p for p in pods if p.name in errors])
    settled(ctx, [R.PodView(p, ()) for p in pods if p.name not in errors], meta["name"])  # unloaded
    failures = list(errors.values())
    ref = custom_ref(ADAPTER_PLURAL, meta["namespace"], meta["name"])
    rows = [
        {"name": p.name, "state": R.UNREACHABLE if p.name in errors else R.UNLOADING, "since": C.now()}
        | ({"message": errors[p.name].message} if p.name in errors else {})
        for p in pods
    ]
    if failures:
        generation = meta.get("generation", 0)
        message = "; ".join(f"{e.pod}: {e.message}" for e in failures)[:1000]
        conds = [
            C.condition(C.READY, C.FALSE, C.UNLOAD_FAILED, "deleting", generation, C.now()),
            C.condition(C.DEGRADED, C.TRUE, C.UNLOAD_FAILED, message, generation, C.now()),
        ]
        await publish(ctx, adapter, ref, {"pods": rows, "conditions": conds})
    metrics.forget_adapter(meta["namespace"], meta["name"])
    return failures
