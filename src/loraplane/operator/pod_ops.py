"""Acting on an adapter's pods through their admin API, many at once (bounded by ``ctx.limit``): observe what
each pod holds, run a call on each and collect the failures by pod, load a version."""

from __future__ import annotations

import asyncio

from loraplane.operator import rollout as R
from loraplane.operator.admin_client import WARM, AdminError, LoadedVersion, PodAddress
from loraplane.operator.context import Context


async def each(ctx: Context, pods, fn) -> list:
    async def one(pod):
        async with ctx.limit:
            return await fn(pod)

    return await asyncio.gather(*(one(p) for p in pods))


async def observe(
    ctx: Context, pods: list[PodAddress], token: str, name: str, shared: bool = False
) -> list[R.PodView]:
    """Each pod's versions of ``name``. ``shared``: from a snapshot of the pod's whole list that every
    adapter asking within ``poll_interval`` shares, so a drift check of N adapters costs one GET per
    pod, not N (a pod event wakes every adapter of the base at once)."""

    async def look(pod: PodAddress) -> R.PodView:
        try:
            if shared:
                return R.PodView(pod, (await snapshot(ctx, pod, token)).get(name, ()))
            return R.PodView(pod, tuple(await ctx.admin.list(pod, token, name)))
        except AdminError as exc:
            return R.PodView(pod, None, exc)

    return await each(ctx, pods, look)


async def snapshot(ctx: Context, pod: PodAddress, token: str) -> dict[str, tuple[LoadedVersion, ...]]:
    """The pod's whole listing by adapter name, shared for ``poll_interval`` seconds (AdminError if it does
    not answer). By name, so each of thousands of adapters finds its versions without scanning the list."""

    async def take() -> dict[str, tuple[LoadedVersion, ...]]:
        by_name: dict[str, tuple[LoadedVersion, ...]] = {}
        for version in await ctx.admin.list(pod, token):
            by_name[version.name] = (*by_name.get(version.name, ()), version)
        return by_name

    return await ctx.snapshots.get(pod, ctx.tunables.poll_interval, take)


def touched(ctx: Context, pods) -> None:
    """After acting on pods, their snapshots are stale."""
    for pod in pods:
        ctx.snapshots.drop(getattr(pod, "address", pod))


def settled(ctx: Context, views: list[R.PodView], name: str) -> None:
    """After acting on ``name`` and observing it again (``views``), each pod's snapshot holds what was just
    observed of ``name`` and stays shared; the rest of the listing is as old as it was (at most
    ``poll_interval``). A pod that did not answer loses its snapshot."""
    for view in views:
        if view.loaded is None:
            ctx.snapshots.drop(view.address)
        else:
            ctx.snapshots.amend(view.address, lambda old, v=view: {**old, name: v.loaded})


async def act(ctx: Context, pods, call) -> dict[str, AdminError]:
    """Run ``call(pod)`` on pods; the errors by pod name."""

    async def attempt(pod):
        try:
            await call(pod)
        except AdminError as exc:
            return pod.name, exc
        return None

    return dict(r for r in await each(ctx, pods, attempt) if r)


async def load(ctx, pod, token, name, request) -> LoadedVersion | AdminError:
    try:
        return await ctx.admin.load(pod, token, name, request)
    except AdminError as exc:
        return exc


async def load_in_batches(
    ctx: Context, views: list[R.PodView], target, max_unavailable, token, request
) -> tuple[dict[str, AdminError], bool, list[R.PodView]]:
    """Load ``target`` beside what each pod serves, ``max_unavailable`` pods at a time (rollout.load_batches),
    stopping at the first batch with an error or a load still warming. Returns (errors by pod, still pending,
    ``views`` with each pod's answer to its load: a pod serves the first version of a name as soon as it is
    warm, and the answer says so, so no switch is asked of it)."""
    errors: dict[str, AdminError] = {}
    pending = False
    answers: dict[str, LoadedVersion] = {}
    for batch in R.load_batches(views, target, max_unavailable):
        results = await each(ctx, batch, lambda v: load(ctx, v.address, token, target.name, request))
        for pod, result in zip(batch, results, strict=True):
            if isinstance(result, AdminError):
                errors[pod.name] = result
                continue
            answers[pod.name] = result
            if result.state != WARM:
                pending = True
        if errors or pending:
            break
    views = [R.with_answer(v, answers[v.name], target) if v.name in answers else v for v in views]
    return errors, pending, views
