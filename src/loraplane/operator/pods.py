"""What the operator needs to know of a server pod, read from its object (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.operator.admin_client import PodAddress

# The server pods' readiness gate (spec.readinessGates): the kubelet counts a pod Ready, and a Service sends
# it requests, only once the operator has set this condition True (readiness_gate.py).
ADAPTERS_GATE = "loraplane.dev/adapters-loaded"


@dataclass(frozen=True, slots=True)
class PodInfo:
    name: str
    ip: str
    ready: bool  # its containers are ready: the server answers and holds its base (the operator may load onto it)
    admin_port: int | None  # the container port named "admin", if declared
    deleting: bool
    routable: bool = False  # the pod's Ready condition: a Service sends it requests
    gated: bool = False  # its spec carries ADAPTERS_GATE
    gate: str | None = None  # the status of the ADAPTERS_GATE condition ("True", "False"), None while unset
    ready_since: str = ""  # when its containers became ready (the condition's lastTransitionTime)

    def address(self, fallback_port: int) -> PodAddress:
        return PodAddress(self.name, self.ip, self.admin_port or fallback_port)


def _conditions(status: dict) -> dict[str, dict]:
    return {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}


def pod_info(body: dict) -> PodInfo:
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    conditions = _conditions(status)
    running = status.get("phase") == "Running"
    # ContainersReady is the server's own readiness probe; a pod without the condition (none written yet by
    # an older kubelet) falls back to Ready, which equals it when the pod has no readiness gate.
    containers = conditions.get("ContainersReady") or conditions.get("Ready") or {}
    port = None
    for container in spec.get("containers") or []:
        for declared in container.get("ports") or []:
            if declared.get("name") == "admin":
                port = declared.get("containerPort")
    gate = conditions.get(ADAPTERS_GATE)
    return PodInfo(
        name=meta.get("name", ""),
        ip=status.get("podIP") or "",
        ready=running and containers.get("status") == "True",
        admin_port=port,
        deleting=bool(meta.get("deletionTimestamp")),
        routable=running and (conditions.get("Ready") or {}).get("status") == "True",
        gated=any(g.get("conditionType") == ADAPTERS_GATE for g in spec.get("readinessGates") or []),
        gate=gate.get("status") if gate else None,
        ready_since=str(containers.get("lastTransitionTime") or ""),
    )


def serving_pods(infos, fallback_port: int) -> list[PodAddress]:
    """Containers ready, addressable, not terminating: the pods that must serve every adapter of the base
    (a gated pod among them too: its gate opens once they are loaded)."""
    chosen = [i for i in infos if i.ready and i.ip and not i.deleting]
    return [i.address(fallback_port) for i in sorted(chosen, key=lambda i: i.name)]
