"""Decode the few protobuf request bodies Go clients send for simple core objects.

client-go (``kubectl create namespace|configmap|secret|serviceaccount``, helm's release Secrets)
writes core types as ``application/vnd.kubernetes.protobuf``: the ``k8s\\0`` magic, then a
``runtime.Unknown`` envelope (typeMeta, raw) whose ``raw`` is the object's own message. Only
Namespace, Secret, ConfigMap, ServiceAccount and DeleteOptions are mapped (field numbers from k8s.io/api
generated.proto); responses are always JSON, which every client accepts.
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

from tests.kube.errors import ApiError

_MAGIC = b"k8s\x00"

# message name -> field number -> (json name, kind); kinds: str, int, bool, bytes, time, map, bmap,
# [str] (repeated string), msg:<Name>, [msg:<Name>] (repeated message)
_MESSAGES: dict[str, dict[int, tuple[str, str]]] = {
    "Unknown": {1: ("typeMeta", "msg:TypeMeta"), 2: ("raw", "bytes")},
    "TypeMeta": {1: ("apiVersion", "str"), 2: ("kind", "str")},
    "ObjectMeta": {
        1: ("name", "str"), 2: ("generateName", "str"), 3: ("namespace", "str"), 5: ("uid", "str"),
        6: ("resourceVersion", "str"), 7: ("generation", "int"), 8: ("creationTimestamp", "time"),
        11: ("labels", "map"), 12: ("annotations", "map"), 13: ("ownerReferences", "[msg:OwnerReference]"),
        14: ("finalizers", "[str]"),
    },
    "OwnerReference": {1: ("kind", "str"), 3: ("name", "str"), 4: ("uid", "str"), 5: ("apiVersion", "str"),
                       6: ("controller", "bool"), 7: ("blockOwnerDeletion", "bool")},
    "Time": {1: ("seconds", "int"), 2: ("nanos", "int")},
    "LocalObjectReference": {1: ("name", "str")},
    "ObjectReference": {1: ("kind", "str"), 2: ("namespace", "str"), 3: ("name", "str")},
    "NamespaceSpec": {1: ("finalizers", "[str]")},
    "Namespace": {1: ("metadata", "msg:ObjectMeta"), 2: ("spec", "msg:NamespaceSpec")},
    "Secret": {1: ("metadata", "msg:ObjectMeta"), 2: ("data", "bmap"), 3: ("type", "str"),
               4: ("stringData", "map"), 5: ("immutable", "bool")},
    "ConfigMap": {1: ("metadata", "msg:ObjectMeta"), 2: ("data", "map"), 3: ("binaryData", "bmap"),
                  4: ("immutable", "bool")},
    "Preconditions": {1: ("uid", "str"), 2: ("resourceVersion", "str")},
    "DeleteOptions": {1: ("gracePeriodSeconds", "int"), 2: ("preconditions", "msg:Preconditions"),
                      3: ("orphanDependents", "bool"), 4: ("propagationPolicy", "str"), 5: ("dryRun", "[str]")},
    "ServiceAccount": {1: ("metadata", "msg:ObjectMeta"), 2: ("secrets", "[msg:ObjectReference]"),
                       3: ("imagePullSecrets", "[msg:LocalObjectReference]"),
                       4: ("automountServiceAccountToken", "bool")},
}  # fmt: skip


def decode(body: bytes) -> dict[str, Any]:
    """The JSON form of a protobuf-encoded object; 415 for kinds this module does not map."""
    if not body.startswith(_MAGIC):
        raise ApiError(400, "BadRequest", "a protobuf body must start with the k8s\\0 magic")
    envelope = _message(body[len(_MAGIC) :], "Unknown")
    type_meta = envelope.get("typeMeta") or {}
    kind = type_meta.get("kind", "")
    if kind not in ("Namespace", "Secret", "ConfigMap", "ServiceAccount", "DeleteOptions"):
        raise ApiError(
            415, "UnsupportedMediaType", f"protobuf bodies of kind {kind!r} are not emulated; send JSON"
        )
    obj = _message(envelope.get("raw", b""), kind)
    return {"apiVersion": type_meta.get("apiVersion", "v1"), "kind": kind, **obj}


def _fields(data: bytes):
    """Yield (field number, value) from protobuf wire format: varints as int, the rest as bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = int.from_bytes(data[pos : pos + size], "little"), pos + size
        else:
            raise ApiError(400, "BadRequest", f"unsupported protobuf wire type {wire}")
        yield number, value


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        result |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return result, pos


def _message(data: bytes, name: str) -> dict[str, Any]:
    spec, out = _MESSAGES[name], {}
    for number, value in _fields(data):
        if number not in spec:
            continue
        field, kind = spec[number]
        if kind.startswith("["):
            out.setdefault(field, []).append(_scalar(value, kind[1:-1]))
        elif kind in ("map", "bmap"):
            entry = dict(_fields(value))
            raw = entry.get(2, b"")
            text = base64.b64encode(raw).decode() if kind == "bmap" else raw.decode()
            out.setdefault(field, {})[entry.get(1, b"").decode()] = text
        else:
            out[field] = _scalar(value, kind)
    return {k: v for k, v in out.items() if v not in ("", 0, False, None, [], {})}  # Go's omitempty


def _scalar(value: Any, kind: str) -> Any:
    if kind == "str":
        return value.decode()
    if kind == "bool":
        return bool(value)
    if kind == "time":
        seconds = _message(value, "Time").get("seconds", 0)
        if not seconds:
            return None
        return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if kind.startswith("msg:"):
        return _message(value, kind[4:])
    return value  # int, bytes
