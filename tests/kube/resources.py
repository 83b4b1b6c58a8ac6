"""Resource types the emulator serves: built-ins, CRD registration, discovery, OpenAPI and Tables.

A resource type is keyed by (group, plural); objects are stored once per type and served in
whatever registered version the client asks for (no conversion: apiVersion is rewritten).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

_ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


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

    def __post_init__(self) -> None:
        if not self.plural or self.plural.lower() != self.plural:
            raise ValueError(f"plural must be a lowercase name, got {self.plural!r}")
        if not self.versions:
            raise ValueError(f"versions of {self.plural} must not be empty")
        self.singular = self.singular or self.kind.lower()

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


def builtin_types() -> list[ResourceType]:
    apps, rbac = "apps", "rbac.authorization.k8s.io"
    return [
        _core("namespaces", "Namespace", namespaced=False, short=("ns",), status_subresource=True),
        _core("pods", "Pod", short=("po",), status_subresource=True),
        _core("services", "Service", short=("svc",), status_subresource=True),
        _core("secrets", "Secret"),
        _core("configmaps", "ConfigMap", short=("cm",)),
        _core("events", "Event", short=("ev",)),
        _core("serviceaccounts", "ServiceAccount", short=("sa",)),
        _core("endpoints", "Endpoints", short=("ep",)),
        _core("persistentvolumeclaims", "PersistentVolumeClaim", short=("pvc",), status_subresource=True),
        _core("nodes", "Node", namespaced=False, short=("no",), status_subresource=True),
        ResourceType(apps, ["v1"], "deployments", "Deployment", True, short_names=["deploy"],
                     status_subresource=True, scale=ScaleSpec(label_selector_path=".spec.selector")),
        ResourceType(apps, ["v1"], "replicasets", "ReplicaSet", True, short_names=["rs"],
                     status_subresource=True, scale=ScaleSpec(label_selector_path=".spec.selector")),
        ResourceType(apps, ["v1"], "statefulsets", "StatefulSet", True, short_names=["sts"],
                     status_subresource=True, scale=ScaleSpec(label_selector_path=".spec.selector")),
        ResourceType("apiextensions.k8s.io", ["v1"], "customresourcedefinitions", "CustomResourceDefinition",
                     False, short_names=["crd", "crds"], status_subresource=True),
        ResourceType("coordination.k8s.io", ["v1"], "leases", "Lease", True),
        ResourceType("events.k8s.io", ["v1"], "events", "Event", True, short_names=["ev"]),
        ResourceType(rbac, ["v1"], "roles", "Role", True),
        ResourceType(rbac, ["v1"], "rolebindings", "RoleBinding", True),
        ResourceType(rbac, ["v1"], "clusterroles", "ClusterRole", False),
        ResourceType(rbac, ["v1"], "clusterrolebindings", "ClusterRoleBinding", False),
        ResourceType("policy", ["v1"], "poddisruptionbudgets", "PodDisruptionBudget", True,
                     short_names=["pdb"], status_subresource=True),
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
            name=c["name"], type=c.get("type", "string"), json_path=c["jsonPath"],
            description=c.get("description", ""), priority=int(c.get("priority", 0)), format=c.get("format", ""),
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
        ) if scale is not None else None,
        printer_columns=columns,
        is_custom=True,
    )


# --- discovery -----------------------------------------------------------------------------------


def resource_list(group: str, version: str, types: list[ResourceType]) -> dict[str, Any]:
    entries = []
    for rt in types:
        entries.append({
            "name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced, "kind": rt.kind,
            "verbs": list(_ALL_VERBS), "shortNames": rt.short_names, "categories": rt.categories,
            "storageVersionHash": "",
        })
        if rt.status_subresource:
            entries.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                            "kind": rt.kind, "verbs": ["get", "patch", "update"]})
        if rt.scale is not None:
            entries.append({"name": f"{rt.plural}/scale", "singularName": "", "namespaced": rt.namespaced,
                            "group": "autoscaling", "version": "v1", "kind": "Scale",
                            "verbs": ["get", "patch", "update"]})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}".lstrip("/"),
            "resources": entries}


def group_entry(group: str, versions: list[str]) -> dict[str, Any]:
    gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}


def openapi_v3_document(group: str, version: str, types: list[ResourceType]) -> dict[str, Any]:
    """A schema-less OpenAPI v3 document: enough for kubectl to see that the server validates fields.

    kubectl looks for the ``fieldValidation`` query parameter on PATCH operations to decide whether
    server-side field validation is supported; every schema is an open object (no client validation).
    """
    paths: dict[str, Any] = {}
    field_validation = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
    for rt in types:
        gvk = [{"group": rt.group, "version": version, "kind": rt.kind}]
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        ns = "/namespaces/{namespace}" if rt.namespaced else ""
        op = {"parameters": [field_validation], "x-kubernetes-group-version-kind": gvk[0],
              "responses": {"200": {"description": "OK"}}}
        paths[f"{prefix}{ns}/{rt.plural}"] = {"post": dict(op), "get": dict(op)}
        paths[f"{prefix}{ns}/{rt.plural}/{{name}}"] = {"patch": dict(op), "put": dict(op), "get": dict(op)}
    schemas = {
        f"{'.'.join(reversed(rt.group.split('.'))) if rt.group else 'io.k8s.api.core'}.{version}.{rt.kind}": {
            "type": "object",
            "x-kubernetes-group-version-kind": [{"group": rt.group, "version": version, "kind": rt.kind}],
            "x-kubernetes-preserve-unknown-fields": True,
        }
        for rt in types
    }
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.37.0"}, "paths": paths,
            "components": {"schemas": schemas}}


# --- server-side Tables (kubectl get) ------------------------------------------------------------


def human_age(timestamp: str | None, now: datetime.datetime | None = None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int(((now or datetime.datetime.now(datetime.UTC)) - then).total_seconds())
    seconds = max(seconds, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size or (unit == "m" and seconds >= 120):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def simple_jsonpath(obj: Any, path: str) -> Any:
    """Resolve ``.a.b[0].c`` and ``.status.conditions[?(@.type=="Ready")].status`` style paths."""
    current = obj
    for part in _split_path(path):
        if current is None:
            return None
        if part.startswith("[?(@."):
            field, _, value = part[5:-2].partition("==")
            value = value.strip().strip("'\"")
            matches = [i for i in current if isinstance(i, dict) and str(i.get(field.strip())) == value]
            current = matches[0] if isinstance(current, list) and matches else None
        elif part.startswith("["):
            index = int(part[1:-1])
            current = current[index] if isinstance(current, list) and -len(current) <= index < len(current) else None
        else:
            current = current.get(part) if isinstance(current, dict) else None
    return current


def _split_path(path: str) -> list[str]:
    parts, buf, depth = [], "", 0
    for ch in path.strip().lstrip("."):
        if ch == "[" and depth == 0:
            if buf:
                parts.append(buf)
            buf, depth = "[", 1
        elif ch == "]" and depth == 1:
            parts.append(buf + "]")
            buf, depth = "", 0
        elif ch == "." and depth == 0:
            if buf:
                parts.append(buf)
            buf = ""
        else:
            buf += ch
    if buf:
        parts.append(buf)
    return parts


def render_table(rt: ResourceType, objects: list[dict[str, Any]], list_rv: str) -> dict[str, Any]:
    """Render a meta.k8s.io/v1 Table: Name + the CRD's printer columns, or Name + Age by default."""
    columns = rt.printer_columns or [
        PrinterColumn("Age", "date", ".metadata.creationTimestamp", "CreationTimestamp is a timestamp")
    ]
    definitions = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                    "description": "Name must be unique within a namespace."}]
    definitions += [{"name": c.name, "type": "string" if c.type == "date" else c.type, "format": c.format,
                     "description": c.description, "priority": c.priority} for c in columns]
    rows = []
    for obj in objects:
        cells: list[Any] = [obj["metadata"]["name"]]
        for column in columns:
            value = simple_jsonpath(obj, column.json_path)
            if column.type == "date":
                value = human_age(value) if value else "<unknown>"
            elif isinstance(value, (dict, list)):
                value = str(value)
            cells.append(value)
        meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
        rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                "metadata": meta}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": list_rv},
            "columnDefinitions": definitions, "rows": rows}
