"""Request plumbing: the request log, URL -> resource target, body decoding, small wire helpers."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import yaml

from tests.kube import protobuf
from tests.kube.errors import ApiError, not_found_url
from tests.kube.resources import ResourceType
from tests.kube.store import Store


@dataclasses.dataclass(slots=True)
class LoggedRequest:
    """One request as the API server saw it (for counting API calls in tests)."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str = ""
    body: bytes = b""
    status: int | None = None  # the response's code, once answered (a watch: when it ends)

    @property
    def is_watch(self) -> bool:
        return truthy(self.query.get("watch")) or "/watch/" in self.path


@dataclasses.dataclass(slots=True)
class Target:
    rt: ResourceType
    version: str
    namespace: str | None
    name: str | None
    subresource: str
    legacy_watch: bool = False


def parse_target(store: Store, parts: list[str]) -> Target:
    """``/api/v1/...`` or ``/apis/<g>/<v>/...`` -> the resource, namespace, name and subresource."""
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        raise not_found_url()
    legacy_watch = rest[:1] == ["watch"]
    rest = rest[1:] if legacy_watch else rest
    namespace = None
    if (
        len(rest) >= 3
        and rest[0] == "namespaces"
        and not (len(rest) == 3 and rest[2] in ("status", "finalize"))
    ):
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        raise not_found_url()
    rt = store.find_type(group, version, rest[0])
    if rt is None or (namespace is not None and not rt.namespaced):
        raise not_found_url()
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else ""
    if rt.namespaced and name is not None and namespace is None:
        raise not_found_url()
    if (
        sub not in ("", "status", "scale", "finalize")
        or (sub == "status" and not rt.status_subresource)
        or (sub == "scale" and rt.scale is None)
    ):
        raise not_found_url()
    return Target(rt, version, namespace, name, sub, legacy_watch)


def truthy(value: str | None) -> bool:
    """Go's strconv.ParseBool, as the API server parses query flags (the Python client sends "True")."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def parse_body(body: bytes, content_type: str) -> Any:
    if content_type == "application/apply-patch+yaml":
        try:
            return yaml.safe_load(body)
        except yaml.YAMLError as e:
            raise ApiError(400, "BadRequest", f"the applied configuration is not YAML: {e}") from e
    if content_type == "application/vnd.kubernetes.protobuf":
        return protobuf.decode(body)
    try:
        return json.loads(body)
    except ValueError as e:
        raise ApiError(
            415, "UnsupportedMediaType", f"the body is not JSON (protobuf/CBOR are not emulated): {e}"
        ) from e


def parse_rv(text: str) -> int:
    if not text.isdigit():
        raise ApiError(400, "BadRequest", f'resourceVersion: Invalid value: "{text}": must be an integer')
    return int(text)


def versioned(rt: ResourceType, version: str, obj: dict[str, Any]) -> dict[str, Any]:
    obj["apiVersion"], obj["kind"] = rt.api_version(version), rt.kind
    return obj
