"""The server pods' readiness gate: a pod takes traffic once it serves the adapters placed on it.

A server pod's own readiness probe passes once its base is loaded; the adapters come after, from the
operator. Without a gate a Service would send a new pod requests for adapters it does not hold yet (404s
for every pod that starts or restarts). So the pod template carries ``readinessGates`` with the condition
``loraplane.dev/adapters-loaded``: the kubelet counts the pod Ready only when its containers are ready *and*
the operator has set that condition True. The operator loads adapters onto pods whose containers are ready
(pods.py), and each pass of the base opens the gate of a pod once:

- every adapter of the base that is served (``status.servingVersion`` set) and placed on the pod
  (placement.py, among the same pods the adapters' own passes use) is served by it: ``GET /admin/adapters``
  lists a version of the name with the alias on it; adapters not served anywhere yet (new, or failing
  validation) do not hold the pod back, since no pod serves them;
- or ``gate_timeout`` seconds have passed since its containers became ready, so one adapter that cannot load
  on this pod never keeps it out of service for good (the adapter's status says what failed).

The gate is opened once per container start: adapters added or rolled later never take a serving pod out of
service. It is closed again when the pod's containers are no longer ready (a restarted server starts empty).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from loraplane.operator import placement
from loraplane.operator.admin_client import AdminError, PodAddress
from loraplane.operator.crd_models import Placement
from loraplane.operator.kube import Ref
from loraplane.operator.pod_ops import snapshot
from loraplane.operator.pods import ADAPTERS_GATE, PodInfo, serving_pods

log = logging.getLogger(__name__)
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


@dataclass(frozen=True, slots=True)
class Adapter:
    """What the gate needs of a LoRAAdapter (handlers.py's index keeps one per adapter)."""

    name: str
    placement: dict  # the raw spec.placement
    served: bool  # status.servingVersion is set: some pod serves it


def adapter_entry(name: str, body: dict) -> Adapter:
    spec, status = body.get("spec") or {}, body.get("status") or {}
    return Adapter(name, dict(spec.get("placement") or {}), bool(status.get("servingVersion")))


def placed_on(pod: str, adapters: Iterable[Adapter], pods: list[PodAddress]) -> list[str]:
    """The served adapters placed on ``pod``, among ``pods`` (the ones every adapter pass places on)."""
    names = []
    for adapter in adapters:
        if not adapter.served:
            continue
        try:
            count = Placement.model_validate(adapter.placement).pods(len(pods))
        except ValueError:  # a malformed placement: its adapter's own pass reports it
            continue
        if any(p.name == pod for p in placement.choose(adapter.name, pods, count)):
            names.append(adapter.name)
    return sorted(names)


def missing(loaded, names: list[str]) -> list[str]:
    """Of ``names``, those the pod's listing does not serve (no version with the alias on it)."""
    serving = {v.name for v in loaded if v.serving and v.state != "failed"}
    return [n for n in names if n not in serving]


def _age(since: str, now: datetime) -> float:
    try:
        return (now - datetime.strptime(since, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)).total_seconds()
    except ValueError:
        return 0.0


def to_close(infos: list[PodInfo]) -> list[PodInfo]:
    """Gated pods whose gate is open while their containers are not ready (a server restarted in place)."""
    return [i for i in infos if i.gated and i.gate == "True" and not i.ready and not i.deleting]


def waiting(infos: list[PodInfo]) -> list[PodInfo]:
    """Gated pods whose containers are ready and whose gate is not open yet."""
    return [i for i in infos if i.gated and i.ready and i.ip and not i.deleting and i.gate != "True"]


async def sync(ctx, namespace: str, infos: list[PodInfo], adapters: list[Adapter], token: str) -> bool:
    """Open and close the gates of a base's pods; True while a pod still waits (poll again soon)."""
    for info in to_close(infos):
        await set_gate(ctx, namespace, info.name, False, "the server's containers are not ready")
    pods = serving_pods(infos, ctx.tunables.admin_port)
    now = datetime.now(UTC)

    async def decide(info: PodInfo) -> bool:
        """Open the pod's gate if it may open; True while it still waits."""
        names = placed_on(info.name, adapters, pods)
        address = info.address(ctx.tunables.admin_port)
        try:
            loaded = [v for versions in (await snapshot(ctx, address, token)).values() for v in versions]
        except AdminError as exc:  # a pod that does not answer waits too (up to the timeout)
            absent = [f"(its admin API: {exc.reason})"]
        else:
            absent = missing(loaded, names)
        if not absent:
            await set_gate(ctx, namespace, info.name, True, f"serves its {len(names)} adapters")
            return False
        if _age(info.ready_since, now) >= ctx.tunables.gate_timeout:
            log.warning("pod %s/%s: opening its gate after %.0f s without %s", namespace, info.name,
                        ctx.tunables.gate_timeout, absent[:5])  # fmt: skip
            await set_gate(ctx, namespace, info.name, True, f"timed out waiting for {len(absent)} adapters")
            return False
        return True

    return any(await asyncio.gather(*(decide(i) for i in waiting(infos))))


async def set_gate(ctx, namespace: str, pod: str, open_: bool, message: str) -> None:
    """The gate's condition on the pod's status (a strategic merge patch: conditions merge by type, so the
    kubelet's own conditions stay)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {"type": ADAPTERS_GATE, "status": "True" if open_ else "False", "lastTransitionTime": now,
                 "reason": "AdaptersLoaded" if open_ else "AdaptersLoading", "message": message}  # fmt: skip
    ref = Ref("/api/v1", "pods", namespace, pod)
    await ctx.kube.patch_status(ref, {"conditions": [condition]}, STRATEGIC_MERGE_PATCH)
