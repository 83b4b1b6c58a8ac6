"""Server-side Tables (``Accept: application/json;as=Table;g=meta.k8s.io;v=v1``), as kubectl get asks.

Columns are Name plus the CRD's additionalPrinterColumns (simple JSONPath), a subset of the built-in
columns for pods, deployments, services, namespaces and CRDs, or Name + Age; ``date`` columns of custom
resources render as ages, the way the API server's CRD table convertor does.
"""

from __future__ import annotations

import datetime
from typing import Any

from tests.kube.resources import ResourceType


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
            current = (
                current[index]
                if isinstance(current, list) and -len(current) <= index < len(current)
                else None
            )
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


# Built-in columns, as `kubectl get` shows them (a subset): (name, type, cell function, priority).
def _pod_ready(pod: dict[str, Any]) -> str:
    total = len((pod.get("spec") or {}).get("containers") or [])
    statuses = (pod.get("status") or {}).get("containerStatuses")
    if statuses is not None:
        return f"{sum(bool(s.get('ready')) for s in statuses)}/{total}"
    ready = simple_jsonpath(pod, '.status.conditions[?(@.type=="Ready")].status') == "True"
    return f"{total if ready else 0}/{total}"


def _pod_status(pod: dict[str, Any]) -> str:
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    return (pod.get("status") or {}).get("phase") or "Unknown"


def _ports(service: dict[str, Any]) -> str:
    ports = (service.get("spec") or {}).get("ports") or []
    return ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in ports) or "<none>"


def _path(path: str, default: Any = "<none>"):
    return lambda obj: v if (v := simple_jsonpath(obj, path)) is not None else default


_AGE = ("Age", "date", _path(".metadata.creationTimestamp", None), 0)
BUILTIN_COLUMNS: dict[tuple[str, str], list[tuple[str, str, Any, int]]] = {
    ("", "pods"): [("Ready", "string", _pod_ready, 0), ("Status", "string", _pod_status, 0),
                   ("Restarts", "integer", lambda p: 0, 0), _AGE,
                   ("IP", "string", _path(".status.podIP"), 1), ("Node", "string", _path(".spec.nodeName"), 1)],
    ("apps", "deployments"): [
        ("Ready", "string", lambda d: f"{_path('.status.readyReplicas', 0)(d)}/{_path('.spec.replicas', 1)(d)}", 0),
        ("Up-to-date", "integer", _path(".status.updatedReplicas", 0), 0),
        ("Available", "integer", _path(".status.availableReplicas", 0), 0), _AGE],
    ("", "services"): [("Type", "string", _path(".spec.type"), 0), ("Cluster-IP", "string", _path(".spec.clusterIP"), 0),
                       ("External-IP", "string", lambda s: "<none>", 0), ("Port(s)", "string", _ports, 0), _AGE],
    ("", "namespaces"): [("Status", "string", _path(".status.phase"), 0), _AGE],
    ("apiextensions.k8s.io", "customresourcedefinitions"): [
        ("Created At", "date", _path(".metadata.creationTimestamp", None), 0)],
}  # fmt: skip


def _columns(rt: ResourceType) -> list[tuple[str, str, Any, int]]:
    if rt.printer_columns:
        return [(c.name, c.type, _path(c.json_path, None), c.priority) for c in rt.printer_columns]
    return BUILTIN_COLUMNS.get(rt.key, [_AGE])


def render_table(rt: ResourceType, objects: list[dict[str, Any]], list_rv: str) -> dict[str, Any]:
    """Render a meta.k8s.io/v1 Table: Name + the CRD's printer columns, built-in columns, or Name + Age."""
    columns = _columns(rt)
    definitions = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                    "description": "Name must be unique within a namespace."}]  # fmt: skip
    definitions += [
        {"name": name, "type": "string" if type_ == "date" else type_, "format": "", "description": "",
         "priority": priority}
        for name, type_, _, priority in columns
    ]  # fmt: skip
    rows = []
    for obj in objects:
        cells: list[Any] = [obj["metadata"]["name"]]
        for name, type_, cell, _ in columns:
            value = cell(obj)
            if type_ == "date":
                value = (
                    (human_age(value) if name == "Age" or rt.is_custom else value) if value else "<unknown>"
                )
            elif isinstance(value, (dict, list)):
                value = str(value)
            cells.append(value)
        meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
        partial = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": meta}
        rows.append({"cells": cells, "object": partial})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": list_rv},
            "columnDefinitions": definitions, "rows": rows}  # fmt: skip


def table_for(rt: ResourceType, objects: list[dict[str, Any]], rv: str, query) -> dict[str, Any]:
    table = render_table(rt, objects, rv)
    if query.get("includeObject") == "Object":
        for row, obj in zip(table["rows"], objects, strict=True):
            row["object"] = obj
    elif query.get("includeObject") == "None":
        for row in table["rows"]:
            row.pop("object", None)
    return table
