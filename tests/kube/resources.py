"""Resource types the emulator serves: built-ins, CRD registration, discovery, OpenAPI and Tables.

A resource type is keyed by (group, plural); objects are stored once per type and served in
whatever registered version the client asks for (no conversion: apiVersion is rewritten).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(slots=True)
class ScaleSpec:
    spec_replicas_path: str = ".spec.replicas"
    status_replicas_path: str = ".status.replicas"
    label_selector_path: str | None = None


@dataclasses.dataclass(slots=True)
class PrinterColumn:
    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0
    format: str = ""


@dataclasses.dataclass(slots=True)
class ResourceType:
    group: str
    versions: list[str]
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: list[str] = dataclasses.field(default_factory=list)
    categories: list[str] = dataclasses.field(default_factory=list)
    status_subresource: bool = False
    scale: ScaleSpec | None = None
    printer_columns: list[PrinterColumn] = dataclasses.field(default_factory=list)
    is_custom: bool = False  # CRD-backed: JSON/merge patches only, PUT needs a resourceVersion
    schemas: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # version -> openAPIV3Schema
    selectable_fields: list[str] = dataclasses.field(
        default_factory=list
    )  # CRD selectableFields, as "spec.x"

    def __post_init__(self) -> None:
        if not self.plural or self.plural.lower() != self.plural:
            raise ValueError(f"plural must be a lowercase name, got {self.plural!r}")
        if not self.versions:
            raise ValueError(f"versions of {self.plural} must not be empty")
        self.singular = self.singular or self.kind.lower()

    @property
    def tracks_generation(self) -> bool:
        """Whether metadata.generation is kept: custom resources and spec-driven built-ins, not data kinds."""
        spec_driven = ("apps", "batch", "policy", "autoscaling", "networking.k8s.io", "apiextensions.k8s.io")
        return self.is_custom or self.group in spec_driven or self.key == ("", "pods")

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def qualified(self) -> str:
        """The name used in API messages: ``pods`` or ``loraadapters.loraplane.dev``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def api_version(self, version: str) -> str:
        return f"{self.group}/{version}" if self.group else version


def _core(plural: str, kind: str, namespaced: bool = True, short: tuple[str, ...] = (), **kw: Any):
    return ResourceType("", ["v1"], plural, kind, namespaced, short_names=list(short), **kw)


def _scalable_workload(plural: str, kind: str, short: str) -> ResourceType:
    """An apps/v1 workload with a status and a scale subresource (selector at .spec.selector)."""
    return ResourceType(
        "apps",
        ["v1"],
        plural,
        kind,
        True,
        short_names=[short],
        categories=["all"],
        status_subresource=True,
        scale=ScaleSpec(label_selector_path=".spec.selector"),
    )


def builtin_types() -> list[ResourceType]:
    rbac = "rbac.authorization.k8s.io"
    return [
        _core("namespaces", "Namespace", namespaced=False, short=("ns",), status_subresource=True),
        _core("pods", "Pod", short=("po",), status_subresource=True, categories=["all"]),
        _core("services", "Service", short=("svc",), status_subresource=True, categories=["all"]),
        _core("secrets", "Secret"),
        _core("configmaps", "ConfigMap", short=("cm",)),
        _core("events", "Event", short=("ev",)),
        _core("serviceaccounts", "ServiceAccount", short=("sa",)),
        _core("endpoints", "Endpoints", short=("ep",)),
        _core("persistentvolumeclaims", "PersistentVolumeClaim", short=("pvc",), status_subresource=True),
        _core("nodes", "Node", namespaced=False, short=("no",), status_subresource=True),
        _scalable_workload("deployments", "Deployment", "deploy"),
        _scalable_workload("replicasets", "ReplicaSet", "rs"),
        _scalable_workload("statefulsets", "StatefulSet", "sts"),
        ResourceType(
            "apiextensions.k8s.io",
            ["v1"],
            "customresourcedefinitions",
            "CustomResourceDefinition",
            False,
            short_names=["crd", "crds"],
            status_subresource=True,
        ),
        ResourceType("coordination.k8s.io", ["v1"], "leases", "Lease", True),
        ResourceType("events.k8s.io", ["v1"], "events", "Event", True, short_names=["ev"]),
        ResourceType(rbac, ["v1"], "roles", "Role", True),
        ResourceType(rbac, ["v1"], "rolebindings", "RoleBinding", True),
        ResourceType(rbac, ["v1"], "clusterroles", "ClusterRole", False),
        ResourceType(rbac, ["v1"], "clusterrolebindings", "ClusterRoleBinding", False),
        ResourceType(
            "policy",
            ["v1"],
            "poddisruptionbudgets",
            "PodDisruptionBudget",
            True,
            short_names=["pdb"],
            status_subresource=True,
        ),
        *_more_builtins(),
    ]


def _more_builtins() -> list[ResourceType]:
    """Kinds a chart may carry beside the operator's own: served, never acted upon."""
    net = "networking.k8s.io"
    return [
        ResourceType(net, ["v1"], "networkpolicies", "NetworkPolicy", True, short_names=["netpol"]),
        ResourceType(net, ["v1"], "ingresses", "Ingress", True, short_names=["ing"], status_subresource=True),
        ResourceType(
            "autoscaling",
            ["v2"],
            "horizontalpodautoscalers",
            "HorizontalPodAutoscaler",
            True,
            short_names=["hpa"],
            status_subresource=True,
        ),
        ResourceType("batch", ["v1"], "jobs", "Job", True, categories=["all"], status_subresource=True),
        ResourceType(
            "batch", ["v1"], "cronjobs", "CronJob", True, short_names=["cj"], status_subresource=True
        ),
        ResourceType(
            "apps",
            ["v1"],
            "daemonsets",
            "DaemonSet",
            True,
            short_names=["ds"],
            categories=["all"],
            status_subresource=True,
        ),
        ResourceType(
            "scheduling.k8s.io", ["v1"], "priorityclasses", "PriorityClass", False, short_names=["pc"]
        ),
        _core(
            "persistentvolumes", "PersistentVolume", namespaced=False, short=("pv",), status_subresource=True
        ),
        _core("resourcequotas", "ResourceQuota", short=("quota",), status_subresource=True),
        _core("limitranges", "LimitRange", short=("limits",)),
    ]


def type_from_crd(crd: dict[str, Any]) -> ResourceType:
    """Build the served resource type from a CustomResourceDefinition body (apiextensions/v1)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    served = [v for v in spec.get("versions") or [] if v.get("served", True)]
    if not spec.get("group") or not names.get("plural") or not names.get("kind") or not served:
        raise ValueError("spec.group, spec.names.plural, spec.names.kind and a served version are required")
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        raise ValueError(f"spec.scope must be Namespaced or Cluster, got {spec.get('scope')!r}")
    # Subresources and columns are per version in v1; the storage version's flavour is served for all.
    storage = next((v for v in served if v.get("storage")), served[0])
    subresources = storage.get("subresources") or {}
    scale = subresources.get("scale")
    columns = [
        PrinterColumn(
            name=c["name"],
            type=c.get("type", "string"),
            json_path=c["jsonPath"],
            description=c.get("description", ""),
            priority=int(c.get("priority", 0)),
            format=c.get("format", ""),
        )
        for c in storage.get("additionalPrinterColumns") or []
    ]
    return ResourceType(
        group=spec["group"],
        versions=[v["name"] for v in served],
        plural=names["plural"],
        kind=names["kind"],
        namespaced=spec["scope"] == "Namespaced",
        singular=names.get("singular", ""),
        short_names=list(names.get("shortNames") or []),
        categories=list(names.get("categories") or []),
        status_subresource="status" in subresources,
        scale=ScaleSpec(
            spec_replicas_path=scale["specReplicasPath"],
            status_replicas_path=scale["statusReplicasPath"],
            label_selector_path=scale.get("labelSelectorPath"),
        )
        if scale is not None
        else None,
        printer_columns=columns,
        schemas={v["name"]: (v.get("schema") or {}).get("openAPIV3Schema") or {} for v in served},
        selectable_fields=[f["jsonPath"].lstrip(".") for f in storage.get("selectableFields") or []],
        is_custom=True,
    )


# --- the scale subresource ---------------------------------------------------------------------


def get_path(obj: Any, path: str) -> Any:
    for part in path.strip(".").split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.strip(".").split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value


def to_scale(rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    spec = rt.scale
    assert spec is not None
    meta = obj["metadata"]
    selector = get_path(obj, spec.label_selector_path) if spec.label_selector_path else None
    if isinstance(selector, dict):  # a LabelSelector object (apps/v1) becomes its string form
        selector = ",".join(f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items())
    status: dict[str, Any] = {"replicas": get_path(obj, spec.status_replicas_path) or 0}
    if selector:
        status["selector"] = selector
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if k in meta
        },
        "spec": {"replicas": get_path(obj, spec.spec_replicas_path) or 0},
        "status": status,
    }
