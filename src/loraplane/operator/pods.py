"""What the operator needs to know of a server pod, read from its object (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.operator.admin_client import PodAddress


@dataclass(frozen=True, slots=True)
class PodInfo:
    name: str
    ip: str
    ready: bool
    admin_port: int | None  # the container port named "admin", if declared
    deleting: bool

    def address(self, fallback_port: int) -> PodAddress:
        return PodAddress(self.name, self.ip, self.admin_port or fallback_port)


def pod_info(body: dict) -> PodInfo:
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    port = None
    for container in spec.get("containers") or []:
        for declared in container.get("ports") or []:
            if declared.get("name") == "admin":
                port = declared.get("containerPort")
    return PodInfo(
        name=meta.get("name", ""),
        ip=status.get("podIP") or "",
        ready=ready and status.get("phase") == "Running",
        admin_port=port,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def serving_pods(infos, fallback_port: int) -> list[PodAddress]:
    """Ready, addressable, not terminating: the pods that must serve every adapter of the base."""
    chosen = [i for i in infos if i.ready and i.ip and not i.deleting]
    return [i.address(fallback_port) for i in sorted(chosen, key=lambda i: i.name)]
