"""Reconcile one LoRABase: apply the objects it owns, then report what its pods say.

Objects come from the pure builders and are applied idempotently (kube.apply writes only when a
field differs). The admin token Secret is created once when the spec references none, and never
rewritten. Status counts the pods (kopf's pod index) and asks each ready pod which base it loaded.
"""

from __future__ import annotations

import asyncio

from loraplane.operator import builders as B
from loraplane.operator import conditions as C
from loraplane.operator import metrics, readiness_gate, routing
from loraplane.operator.admin_client import AdminError, PodAddress
from loraplane.operator.context import Context
from loraplane.operator.crd_models import BASE_PLURAL, BaseSpec, SpecError
from loraplane.operator.crd_objects import LoRABase
from loraplane.operator.kube import custom_ref
from loraplane.operator.pods import PodInfo
from loraplane.operator.publish import publish
from loraplane.operator.validation import ValidationFailed, check_base_policy


async def apply_objects(ctx: Context, base: dict, spec: BaseSpec, image: str | None = None) -> list[str]:
    """Apply the owned objects; the names of those created or updated. ``image``: what the policy allows."""
    changed = []
    if spec.admin_token is None and await ctx.kube.create_if_absent(B.build_admin_token_secret(base)):
        changed.append(f"Secret/{base['metadata']['name']}-admin-token")
    objects = [
        B.build_deployment(base, spec, image, ctx.routing),
        B.build_service(base),
        B.build_admin_service(base),
    ]
    for obj in objects:
        if await ctx.kube.apply(obj) != "unchanged":
            changed.append(f"{obj['kind']}/{obj['metadata']['name']}")
    if ctx.routing and await ctx.kube.serves(routing.POOL_VERSION, routing.POOL_PLURAL):
        pool = routing.build_inference_pool(base)  # one made by someone else (GIE's chart) stays theirs
        if await ctx.kube.apply(pool, adopt=False) in ("created", "updated"):
            changed.append(f"InferencePool/{pool['metadata']['name']}")
    return changed


async def admin_token(ctx: Context, base: dict, spec: BaseSpec) -> str:
    data = await ctx.kube.secret_data(base["metadata"]["namespace"], B.admin_token_secret_name(base, spec))
    return (data or {}).get(B.admin_token_key(spec), "")


async def observed_hashes(ctx: Context, pods: list[PodAddress], token: str) -> dict[str, str]:
    """Pod name -> the base hash it reports on /health/ready ("" when it does not answer)."""

    async def ask(pod: PodAddress) -> tuple[str, str]:
        async with ctx.limit:
            try:
                return pod.name, str((await ctx.admin.ready(pod, token)).get("base_hash", ""))
            except (AdminError, ValueError):
                return pod.name, ""

    return dict(await asyncio.gather(*(ask(p) for p in pods)))


def base_status(base: dict, spec: BaseSpec, infos: list[PodInfo], hashes: dict[str, str]) -> dict:
    generation = base["metadata"].get("generation", 0)
    now = C.now()
    live = [i for i in infos if not i.deleting]
    ready = [i for i in live if i.routable]  # Ready: taking traffic (for a gated pod, its adapters loaded)
    wrong = sorted(name for name, h in hashes.items() if h and h != spec.model_sha256)
    reported = {h for h in hashes.values() if h}
    conds = []
    if len(ready) >= spec.replicas and spec.replicas > 0:
        conds.append((C.READY, C.TRUE, C.DEPLOYMENT_AVAILABLE, f"{len(ready)}/{spec.replicas} pods ready"))
    elif spec.replicas == 0:
        conds.append((C.READY, C.TRUE, C.DEPLOYMENT_AVAILABLE, "scaled to zero"))
    else:
        conds.append((C.READY, C.FALSE, C.PODS_NOT_READY, f"{len(ready)}/{spec.replicas} pods ready"))
    if len(live) != spec.replicas or len(ready) != len(live):
        conds.append(
            (C.PROGRESSING, C.TRUE, C.DEPLOYMENT_PROGRESSING, f"{len(live)} pods, {spec.replicas} desired")
        )
    else:
        conds.append((C.PROGRESSING, C.FALSE, C.DEPLOYMENT_STABLE, f"{len(live)} pods"))
    if wrong:
        conds.append((C.DEGRADED, C.TRUE, C.POD_BASE_MISMATCH, f"pods {wrong} report another base hash"))
    else:
        conds.append((C.DEGRADED, C.FALSE, C.AS_EXPECTED, "no failure"))
    return {
        "observedGeneration": generation,
        "replicas": len(live),
        "readyReplicas": len(ready),
        "selector": B.selector_string(base["metadata"]["name"]),
        "observedBaseHash": reported.pop() if len(reported) == 1 else None,
        "endpoint": B.endpoint(base),
        "adminTokenSecret": B.admin_token_secret_name(base, spec),
        "conditions": [C.condition(t, s, r, m, generation, now) for t, s, r, m in conds],
    }


def invalid_status(base: dict, reason: str, message: str) -> dict:
    """A spec the operator will not act on (malformed, or against its policy): nothing is applied."""
    generation = base["metadata"].get("generation", 0)
    now = C.now()
    return {
        "observedGeneration": generation,
        "conditions": [
            C.condition(C.READY, C.FALSE, reason, message, generation, now),
            C.condition(C.PROGRESSING, C.FALSE, reason, message, generation, now),
            C.condition(C.DEGRADED, C.TRUE, reason, message, generation, now),
        ],
    }


async def reconcile(
    ctx: Context, base: dict, infos: list[PodInfo], adapters: list[readiness_gate.Adapter] = ()
) -> float:
    """One pass; returns the seconds until the next one. ``adapters``: the base's, for its pods' gates."""
    meta = base["metadata"]
    ref = custom_ref(BASE_PLURAL, meta["namespace"], meta["name"])
    with metrics.reconcile_timer("LoRABase") as outcome:
        if not (base.get("status") or {}).get("conditions"):
            first = {"conditions": C.initial(C.BASE_CONDITIONS, meta.get("generation", 0))}
            await publish(ctx, base, ref, first)
            base = {**base, "status": first}
        try:
            spec = LoRABase.parse(base).spec
        except SpecError as exc:
            await publish(ctx, base, ref, invalid_status(base, "InvalidSpec", str(exc)))
            outcome["result"] = "invalid"
            return ctx.tunables.drift_interval
        try:  # the operator's rules first: a LoRABase that breaks one changes no object
            image = await check_base_policy(ctx, meta["namespace"], base, spec)
        except ValidationFailed as exc:
            await publish(ctx, base, ref, invalid_status(base, exc.reason, exc.message))
            outcome["result"] = "refused"
            return ctx.tunables.retry_delay if exc.transient else ctx.tunables.drift_interval
        await apply_objects(ctx, base, spec, image)
        token = await admin_token(ctx, base, spec)
        ready = [i.address(ctx.tunables.admin_port) for i in infos if i.ready and i.ip and not i.deleting]
        hashes = await observed_hashes(ctx, ready, token)
        gates_pending = await readiness_gate.sync(ctx, meta["namespace"], infos, list(adapters), token)
        status = base_status(base, spec, infos, hashes)
        await publish(ctx, base, ref, status)
        outcome["result"] = "ok"
    settled = C.get(status["conditions"], C.PROGRESSING)["status"] == C.FALSE and not gates_pending
    return ctx.tunables.drift_interval if settled else ctx.tunables.poll_interval
