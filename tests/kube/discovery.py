"""Discovery (/api, /apis, resource lists) and a schema-less /openapi/v3, from the store's types."""

from __future__ import annotations

from typing import Any

import aiohttp.web

from tests.kube.errors import json_response, not_found_url
from tests.kube.resources import ResourceType
from tests.kube.store import Store

_ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


def resource_list(group: str, version: str, types: list[ResourceType]) -> dict[str, Any]:
    entries = []
    for rt in types:
        entries.append(
            {
                "name": rt.plural,
                "singularName": rt.singular,
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": list(_ALL_VERBS),
                "shortNames": rt.short_names,
                "categories": rt.categories,
                "storageVersionHash": "",
            }
        )
        if rt.status_subresource:
            entries.append(
                {
                    "name": f"{rt.plural}/status",
                    "singularName": "",
                    "namespaced": rt.namespaced,
                    "kind": rt.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        if rt.scale is not None:
            entries.append(
                {
                    "name": f"{rt.plural}/scale",
                    "singularName": "",
                    "namespaced": rt.namespaced,
                    "group": "autoscaling",
                    "version": "v1",
                    "kind": "Scale",
                    "verbs": ["get", "patch", "update"],
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}".lstrip("/"),
        "resources": entries,
    }


def group_entry(group: str, versions: list[str]) -> dict[str, Any]:
    gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}


def openapi_v3_document(group: str, version: str, types: list[ResourceType]) -> dict[str, Any]:
    """An OpenAPI v3 document: enough for kubectl to see that the server validates fields.

    kubectl looks for the ``fieldValidation`` query parameter on PATCH operations to decide whether
    server-side field validation is supported. Custom resources carry their CRD's openAPIV3Schema
    (so ``kubectl explain`` works); built-ins are open objects.
    """
    paths: dict[str, Any] = {}
    field_validation = {
        "name": "fieldValidation",
        "in": "query",
        "schema": {"type": "string", "uniqueItems": True},
    }
    for rt in types:
        gvk = [{"group": rt.group, "version": version, "kind": rt.kind}]
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        ns = "/namespaces/{namespace}" if rt.namespaced else ""
        op = {
            "parameters": [field_validation],
            "x-kubernetes-group-version-kind": gvk[0],
            "responses": {"200": {"description": "OK"}},
        }
        paths[f"{prefix}{ns}/{rt.plural}"] = {"post": dict(op), "get": dict(op)}
        paths[f"{prefix}{ns}/{rt.plural}/{{name}}"] = {"patch": dict(op), "put": dict(op), "get": dict(op)}
    schemas = {
        f"{'.'.join(reversed(rt.group.split('.'))) if rt.group else 'io.k8s.api.core'}.{version}.{rt.kind}": {
            "type": "object",
            **(rt.schemas.get(version) or {"x-kubernetes-preserve-unknown-fields": True}),
            "x-kubernetes-group-version-kind": [{"group": rt.group, "version": version, "kind": rt.kind}],
        }
        for rt in types
    }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.37.0"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def serve_discovery(
    store: Store, raw: aiohttp.web.BaseRequest, parts: list[str]
) -> aiohttp.web.Response | None:
    types = list(store.types.values())
    if not parts:
        paths = ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/readyz", "/version", "/openapi/v3"]
        paths += sorted({f"/apis/{rt.group}/{v}" for rt in types if rt.group for v in rt.versions})
        return json_response({"paths": paths})
    if parts in (["healthz"], ["livez"], ["readyz"]):
        return aiohttp.web.Response(text="ok")
    if parts == ["version"]:
        return json_response(
            {"major": "1", "minor": "37", "gitVersion": "v1.37.0-kmock", "platform": "linux/amd64"}
        )
    if parts == ["api"]:
        return json_response(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": f"{raw.host}"}],
            }
        )
    if parts == ["api", "v1"]:
        return json_response(resource_list("", "v1", [rt for rt in types if rt.group == ""]))
    if parts == ["apis"]:
        groups: dict[str, list[str]] = {}
        for rt in types:
            if rt.group:
                groups.setdefault(rt.group, [])
                groups[rt.group] += [v for v in rt.versions if v not in groups[rt.group]]
        return json_response(
            {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [group_entry(g, vs) for g, vs in sorted(groups.items())],
            }
        )
    if parts[0] == "apis" and len(parts) == 2:
        versions = [v for rt in types if rt.group == parts[1] for v in rt.versions]
        if not versions:
            raise not_found_url()
        return json_response(
            {
                "kind": "APIGroup",
                "apiVersion": "v1",
                **group_entry(parts[1], list(dict.fromkeys(versions))),
            }
        )
    if parts[0] == "apis" and len(parts) == 3:
        served = [rt for rt in types if rt.group == parts[1] and parts[2] in rt.versions]
        if not served:
            raise not_found_url()
        return json_response(resource_list(parts[1], parts[2], served))
    return None


def serve_openapi(store: Store, rest: list[str]) -> aiohttp.web.Response:
    types = list(store.types.values())
    gvs = sorted({(rt.group, v) for rt in types for v in rt.versions})
    if not rest:

        def url(g: str, v: str) -> str:
            return f"apis/{g}/{v}" if g else f"api/{v}"

        stamp = str(store.resource_version)
        return json_response(
            {
                "paths": {
                    url(g, v): {"serverRelativeURL": f"/openapi/v3/{url(g, v)}?hash={stamp}"} for g, v in gvs
                }
            }
        )
    group, version = (
        ("", rest[1])
        if rest[0] == "api" and len(rest) == 2
        else (rest[1], rest[2])
        if rest[0] == "apis" and len(rest) == 3
        else (None, None)
    )
    served = [rt for rt in types if rt.group == group and version in rt.versions]
    if not served:
        raise not_found_url()
    return json_response(openapi_v3_document(group or "", version or "", served))
