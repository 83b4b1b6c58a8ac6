"""Pure rollout logic: from what each pod reports, what to do next and what status says.

A version rolls in three phases, each only once the previous one holds on every pod:
  load    PUT the target on every pod lacking it warm (beside any old version; at most
          ``maxUnavailable`` pods at once where an old version serves),
  switch  POST the alias to the target on every pod (all warm; none unreachable),
  cleanup DELETE every other version of the adapter (only once all pods serve the target).
A failure in load or switch rolls back: pods serving the target that still hold an old version
switch back to it, and the target is unloaded where it does not serve. So the old version keeps
serving everywhere, and a half switch never persists.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loraplane.operator.admin_client import (
    CACHED,
    FAILED,
    LOADED,
    WARM,
    AdminError,
    LoadedVersion,
    PodAddress,
)

# status.pods[].state
PENDING, LOADING, WARM_STATE, SERVING, FAILED_STATE, UNREACHABLE, UNLOADING = (
    "Pending",
    "Loading",
    "Warm",
    "Serving",
    "Failed",
    "Unreachable",
    "Unloading",
)


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # the adapter (CR) name: the alias clients use
    version: str
    digest: str  # "sha256:<hex>": the identity; a version label alone is not trusted

    def matches(self, loaded: LoadedVersion) -> bool:
        return loaded.name == self.name and loaded.version == self.version and loaded.digest == self.digest


@dataclass(frozen=True, slots=True)
class PodView:
    address: PodAddress
    loaded: tuple[LoadedVersion, ...] | None = None  # None: unreachable
    error: AdminError | None = None

    @property
    def name(self) -> str:
        return self.address.name

    @property
    def reachable(self) -> bool:
        return self.loaded is not None

    def of(self, adapter: str) -> list[LoadedVersion]:
        return [v for v in self.loaded or () if v.name == adapter]

    def target(self, target: Target) -> LoadedVersion | None:
        return next((v for v in self.of(target.name) if target.matches(v)), None)

    def serving(self, adapter: str) -> LoadedVersion | None:
        return next((v for v in self.of(adapter) if v.serving), None)

    def others(self, target: Target) -> list[LoadedVersion]:
        return [v for v in self.of(target.name) if not target.matches(v)]


def needs_load(pod: PodView, target: Target) -> bool:
    loaded = pod.target(target)
    return pod.reachable and (loaded is None or loaded.state != WARM)


def needs_switch(pod: PodView, target: Target) -> bool:
    serving = pod.serving(target.name)
    return pod.reachable and (serving is None or not target.matches(serving))


def needs_cleanup(pod: PodView, target: Target) -> list[LoadedVersion]:
    return pod.others(target) if pod.reachable else []


def old_serving(pod: PodView, target: Target) -> bool:
    serving = pod.serving(target.name)
    return serving is not None and not target.matches(serving)


def with_answer(pod: PodView, answer: LoadedVersion, target: Target) -> PodView:
    """``pod`` as its answer to a load of ``target`` shows it (that version's state, and the alias if it
    moved to it); an answer about anything else changes nothing."""
    if not pod.reachable or not target.matches(answer):
        return pod
    others = tuple(replace(v, serving=False) if answer.serving else v for v in pod.others(target))
    rest = tuple(v for v in pod.loaded or () if v.name != target.name)
    return PodView(pod.address, rest + others + (answer,), pod.error)


def load_batches(pods: list[PodView], target: Target, max_unavailable: int) -> list[list[PodView]]:
    """Fresh pods all at once (nothing to protect); pods serving an old version, maxUnavailable at a time."""
    todo = [p for p in pods if needs_load(p, target)]
    fresh = [p for p in todo if not old_serving(p, target)]
    busy = [p for p in todo if old_serving(p, target)]
    batches = [busy[i : i + max_unavailable] for i in range(0, len(busy), max_unavailable)]
    if fresh:
        batches = [fresh + (batches[0] if batches else [])] + batches[1:]
    return batches


@dataclass(frozen=True, slots=True)
class Undo:
    """One rollback step: switch ``pod`` back to ``version`` and/or unload the target there."""

    pod: PodView
    switch_to: str | None
    unload_target: bool


def rollback_plan(pods: list[PodView], target: Target) -> list[Undo]:
    plan = []
    for pod in pods:
        if not pod.reachable:
            continue
        loaded, serving = pod.target(target), pod.serving(target.name)
        old = next((v for v in pod.others(target) if v.state == WARM), None)
        switch_to = old.version if (serving is not None and target.matches(serving) and old) else None
        unload = loaded is not None and (switch_to is not None or not loaded.serving)
        if switch_to or unload:
            plan.append(Undo(pod, switch_to, unload))
    return plan


def pod_row(pod: PodView, target: Target, previous: dict | None, now: str) -> dict:
    """One entry of status.pods: the pod's state for the desired version and what it serves."""
    serving = pod.serving(target.name) if pod.reachable else None
    if not pod.reachable:
        state, message = UNREACHABLE, pod.error.message if pod.error else "no answer"
    else:
        loaded = pod.target(target)
        message = ""
        if loaded is None:
            state = PENDING
        elif loaded.state == FAILED:
            state, message = FAILED_STATE, loaded.message
        elif loaded.state != WARM:
            state = LOADING
        elif loaded.serving:
            state = SERVING
        else:
            state = WARM_STATE
        if pod.error is not None:  # the last action on this pod failed
            state, message = FAILED_STATE, f"{pod.error.reason}: {pod.error.message}"
    since = previous.get("since") if previous and previous.get("state") == state else now
    row = {"name": pod.name, "state": state, "since": since or now}
    if serving is not None:
        row["version"] = serving.version
    if message:
        row["message"] = message[:512]
    return row


def serving_version(pods: list[PodView], adapter: str) -> LoadedVersion | None:
    """The version most reachable pods route ``adapter`` to (ties: the first seen)."""
    counts: dict[tuple[str, str], list] = {}
    for pod in pods:
        serving = pod.serving(adapter) if pod.reachable else None
        if serving is not None:
            counts.setdefault((serving.version, serving.digest), []).append(serving)
    if not counts:
        return None
    return max(counts.values(), key=len)[0]


def cached_everywhere(pods: list[PodView], target: Target, desired: int) -> bool:
    states = [(p.target(target) or LoadedVersion("", "", "", "", False)).state for p in pods if p.reachable]
    return len([s for s in states if s in (CACHED, LOADED, WARM)]) >= desired
