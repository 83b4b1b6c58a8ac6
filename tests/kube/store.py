"""The emulator's object store: API-server semantics over plain dicts, safe to call from any thread.

Every mutation takes one lock, bumps one global resourceVersion counter, appends to a bounded event
history and pushes the event to live watchers (each watcher belongs to an asyncio loop; events are
delivered with ``call_soon_threadsafe``). Objects of a type are stored once, whatever the version.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import datetime
import re
import secrets
import threading
import uuid
from collections.abc import Callable
from typing import Any

from tests.kube import patching
from tests.kube.resources import ResourceType, builtin_types, type_from_crd

ObjectKey = tuple[tuple[str, str], str, str]  # ((group, plural), namespace or "", name)
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME_RE = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACE_KEY = ("", "namespaces")


class ApiError(Exception):
    """An API failure rendered as a ``kind: Status`` body."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def body(self) -> dict[str, Any]:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "details": self.details, "code": self.code}

    @classmethod
    def not_found(cls, rt: ResourceType, name: str) -> ApiError:
        return cls(404, "NotFound", f'{rt.qualified} "{name}" not found', _details(rt, name))

    @classmethod
    def conflict(cls, rt: ResourceType, name: str, why: str = "") -> ApiError:
        why = why or "the object has been modified; please apply your changes to the latest version and try again"
        return cls(409, "Conflict", f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}',
                   _details(rt, name))

    @classmethod
    def invalid(cls, rt: ResourceType, name: str, field: str, why: str) -> ApiError:
        return cls(422, "Invalid", f'{rt.kind} "{name}" is invalid: {field}: {why}',
                   {**_details(rt, name), "causes": [{"reason": "FieldValueInvalid", "message": why,
                                                       "field": field}]})


def _details(rt: ResourceType, name: str) -> dict[str, Any]:
    return {"name": name, "group": rt.group, "kind": rt.plural}


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(slots=True, frozen=True)
class Event:
    rv: int
    type_key: tuple[str, str]
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclasses.dataclass(slots=True)
class Watcher:
    type_key: tuple[str, str]
    namespace: str | None
    matches: Callable[[dict[str, Any]], bool]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def offer(self, event: Event) -> None:
        out = self.translate(event)
        if out is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)

    def translate(self, event: Event) -> tuple[str, dict[str, Any]] | None:
        """Selector transitions become ADDED/DELETED, as the real watch cache does."""
        if event.type_key != self.type_key:
            return None
        if self.namespace is not None and event.obj["metadata"].get("namespace") != self.namespace:
            return None
        now = self.matches(event.obj)
        before = event.old is not None and self.matches(event.old)
        if event.type == "MODIFIED":
            if now and not before:
                return ("ADDED", event.obj)
            if before and not now:
                return ("DELETED", event.obj)
        return (event.type, event.obj) if now else None


def _generation_relevant(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


class Store:
    def __init__(self, history_limit: int = 5000) -> None:
        self.lock = threading.RLock()
        self.types: dict[tuple[str, str], ResourceType] = {rt.key: rt for rt in builtin_types()}
        self.objects: dict[ObjectKey, dict[str, Any]] = {}
        self.history: collections.deque[Event] = collections.deque(maxlen=history_limit)
        self.history_truncated = False
        self.watchers: list[Watcher] = []
        self._rv = 0
        self._orphaning: set[str] = set()  # uids deleted with propagationPolicy=Orphan
        for ns in ("default", "kube-system", "kube-public"):
            self.create(self.types[NAMESPACE_KEY], "", {"metadata": {"name": ns}})

    # --- lookups -------------------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._rv

    def find_type(self, group: str, version: str, plural: str) -> ResourceType | None:
        rt = self.types.get((group, plural))
        return rt if rt is not None and version in rt.versions else None

    def type_by_kind(self, api_version: str, kind: str) -> ResourceType:
        group, _, version = api_version.rpartition("/")
        for rt in self.types.values():
            if rt.group == group and rt.kind == kind and version in rt.versions:
                return rt
        raise KeyError(f"no resource for apiVersion={api_version} kind={kind}")

    def get(self, rt: ResourceType, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            obj = self.objects.get((rt.key, namespace, name))
            if obj is None:
                raise ApiError.not_found(rt, name)
            return copy.deepcopy(obj)

    def list(self, rt: ResourceType, namespace: str | None, matches: Callable[[dict], bool]) -> tuple[list, int]:
        with self.lock:
            items = [
                copy.deepcopy(obj) for (key, ns, _), obj in self.objects.items()
                if key == rt.key and (namespace is None or ns == namespace) and matches(obj)
            ]
            return sorted(items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])), self._rv

    # --- watch ---------------------------------------------------------------------------------

    def subscribe(self, watcher: Watcher, since: int | None) -> list[tuple[str, dict[str, Any]]]:
        """Register a watcher; return the events it missed: a synthetic ADDED per object or history."""
        with self.lock:
            self.watchers.append(watcher)
            if since is None:
                items, _ = self.list(self.types[watcher.type_key], watcher.namespace, watcher.matches)
                return [("ADDED", obj) for obj in items]
            oldest = self.history[0].rv if self.history else self._rv + 1
            if self.history_truncated and since < oldest - 1:
                self.watchers.remove(watcher)
                raise ApiError(410, "Expired", f"too old resource version: {since} ({oldest - 1})")
            return [out for e in self.history if e.rv > since if (out := watcher.translate(e)) is not None]

    def unsubscribe(self, watcher: Watcher) -> None:
        with self.lock:
            if watcher in self.watchers:
                self.watchers.remove(watcher)

    def _emit(self, rt: ResourceType, type_: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        if len(self.history) == self.history.maxlen:
            self.history_truncated = True
        event = Event(int(obj["metadata"]["resourceVersion"]), rt.key, type_, copy.deepcopy(obj), old)
        self.history.append(event)
        for watcher in list(self.watchers):
            watcher.offer(event)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    # --- create --------------------------------------------------------------------------------

    def create(self, rt: ResourceType, namespace: str, body: dict[str, Any], dry_run: bool = False) -> dict:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "BadRequest", "metadata must be an object")
        with self.lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
            name = meta.get("name") or ""
            self._validate_meta(rt, obj, name)
            if rt.namespaced:
                if meta.get("namespace", namespace) != namespace:
                    raise ApiError(400, "BadRequest", "the namespace of the provided object does not match "
                                   "the namespace sent on the request")
                if (NAMESPACE_KEY, "", namespace) not in self.objects:
                    raise ApiError.not_found(self.types[NAMESPACE_KEY], namespace)
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            key = (rt.key, namespace if rt.namespaced else "", name)
            if key in self.objects:
                raise ApiError(409, "AlreadyExists", f'{rt.qualified} "{name}" already exists',
                               _details(rt, name))
            for field in ("resourceVersion", "uid", "deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(field, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            obj["kind"], obj["apiVersion"] = rt.kind, rt.api_version(rt.versions[0])
            if rt.status_subresource:
                obj.pop("status", None)
            self._on_create_defaults(rt, obj)
            if dry_run:
                return obj
            meta["resourceVersion"] = self._next_rv()
            self.objects[key] = obj
            self._emit(rt, "ADDED", obj, None)
            return copy.deepcopy(obj)

    def _validate_meta(self, rt: ResourceType, obj: dict[str, Any], name: str) -> None:
        if not name:
            raise ApiError.invalid(rt, name, "metadata.name", "Required value: name or generateName is required")
        if len(name) > 253 or not _NAME_RE.match(name):
            raise ApiError.invalid(rt, name, "metadata.name", f'Invalid value: "{name}": a lowercase RFC 1123 '
                                   "subdomain must consist of lower case alphanumeric characters, '-' or '.'")
        for key, value in (obj["metadata"].get("labels") or {}).items():
            if not _LABEL_NAME_RE.match(key) or not isinstance(value, str) or len(value) > 63 \
                    or not _LABEL_VALUE_RE.match(value):
                raise ApiError.invalid(rt, name, f"metadata.labels[{key}]", f'Invalid value: "{value}"')

    def _on_create_defaults(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        if rt.key == NAMESPACE_KEY:
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        elif rt.key == ("", "pods"):
            obj["status"] = {"phase": "Pending"}
        elif rt.key == CRD_KEY:
            self._register_crd(obj)

    def _register_crd(self, crd: dict[str, Any]) -> None:
        try:
            new_type = type_from_crd(crd)
        except (KeyError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f'CustomResourceDefinition "{crd["metadata"]["name"]}" is invalid: {e}')
        expected = f"{new_type.plural}.{new_type.group}"
        if crd["metadata"]["name"] != expected:
            raise ApiError(422, "Invalid", f'CustomResourceDefinition "{crd["metadata"]["name"]}" is invalid: '
                           f'metadata.name: Invalid value: must be spec.names.plural+"."+spec.group ({expected})')
        existing = self.types.get(new_type.key)
        if existing is not None and not existing.is_custom:
            raise ApiError(422, "Invalid", f"{expected} collides with a built-in resource")
        self.types[new_type.key] = new_type
        names = crd["spec"]["names"]
        accepted = {**names, "singular": new_type.singular, "listKind": names.get("listKind", names["kind"] + "List")}
        stamp = now_rfc3339()
        crd["status"] = {
            "acceptedNames": accepted,
            "storedVersions": [new_type.versions[0]],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": stamp},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted", "lastTransitionTime": stamp},
            ],
        }

    # --- update --------------------------------------------------------------------------------

    def update(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        change: Callable[[dict[str, Any]], dict[str, Any]],
        subresource: str = "",
        dry_run: bool = False,
        require_rv: bool = False,
    ) -> dict[str, Any]:
        """Apply ``change`` (current -> candidate) with the API's rules for the given subresource."""
        with self.lock:
            key = (rt.key, namespace, name)
            current = self.objects.get(key)
            if current is None:
                raise ApiError.not_found(rt, name)
            candidate = change(copy.deepcopy(current))
            if not isinstance(candidate, dict):
                raise ApiError(400, "BadRequest", "the patched object is not a JSON object")
            meta = candidate.setdefault("metadata", {})
            given_rv = meta.get("resourceVersion")
            if require_rv and not given_rv:
                raise ApiError.invalid(rt, name, "metadata.resourceVersion",
                                       "Invalid value: 0x0: must be specified for an update")
            if given_rv and given_rv != current["metadata"]["resourceVersion"]:
                raise ApiError.conflict(rt, name)
            if meta.get("name", name) != name:
                raise ApiError(400, "BadRequest", f'the name of the object ({meta.get("name")}) does not match '
                               f"the name on the URL ({name})")
            new = self._merge_by_subresource(rt, current, candidate, subresource)
            self._validate_meta(rt, new, name)
            if new == current:
                return copy.deepcopy(current)  # a no-op write keeps the resourceVersion, as the API does
            if _generation_relevant(new) != _generation_relevant(current):
                new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            if rt.key == CRD_KEY and subresource == "":
                self._register_crd(new)
            if dry_run:
                return new
            new["metadata"]["resourceVersion"] = self._next_rv()
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                self._remove(rt, key, new)
            else:
                self.objects[key] = new
                self._emit(rt, "MODIFIED", new, current)
            return copy.deepcopy(new)

    def _merge_by_subresource(self, rt: ResourceType, current: dict, candidate: dict, sub: str) -> dict:
        if sub == "status":
            new = copy.deepcopy(current)
            if "status" in candidate:
                new["status"] = candidate["status"]
            else:
                new.pop("status", None)
            return new
        new = candidate
        if rt.status_subresource:
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
            else:
                new.pop("status", None)
        new["kind"], new["apiVersion"] = current["kind"], current["apiVersion"]
        meta, old_meta = new["metadata"], current["metadata"]
        for field in ("uid", "creationTimestamp", "namespace", "generation", "resourceVersion",
                      "deletionTimestamp", "deletionGracePeriodSeconds", "name"):
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise ApiError(422, "Invalid", f"metadata.finalizers: Forbidden: no new finalizers can be added "
                               f"if the object is being deleted, found new finalizers {sorted(added)}")
        for field in ("finalizers", "labels", "annotations", "ownerReferences"):
            if field in meta and not meta[field]:
                del meta[field]
        return new

    # --- delete --------------------------------------------------------------------------------

    def delete(self, rt: ResourceType, namespace: str, name: str, options: dict[str, Any] | None = None,
               dry_run: bool = False) -> dict[str, Any]:
        options = options or {}
        with self.lock:
            key = (rt.key, namespace, name)
            current = self.objects.get(key)
            if current is None:
                raise ApiError.not_found(rt, name)
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != current["metadata"]["uid"]:
                raise ApiError.conflict(rt, name, f"Precondition failed: UID in precondition: {pre['uid']}, "
                                        f"UID in object meta: {current['metadata']['uid']}")
            if pre.get("resourceVersion") and pre["resourceVersion"] != current["metadata"]["resourceVersion"]:
                raise ApiError.conflict(rt, name)
            if dry_run:
                return copy.deepcopy(current)
            if options.get("propagationPolicy") == "Orphan":
                self._orphaning.add(current["metadata"]["uid"])
            if current["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(current)
            if current["metadata"].get("finalizers") or rt.key == NAMESPACE_KEY:
                new = copy.deepcopy(current)
                new["metadata"]["deletionTimestamp"] = now_rfc3339()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
                new["metadata"]["resourceVersion"] = self._next_rv()
                if rt.key == NAMESPACE_KEY:
                    new["status"] = {"phase": "Terminating"}
                self.objects[key] = new
                self._emit(rt, "MODIFIED", new, current)
                if rt.key == NAMESPACE_KEY:
                    self._drain_namespace(name)
                return copy.deepcopy(self.objects.get(key, new))
            removed = copy.deepcopy(current)
            removed["metadata"]["resourceVersion"] = self._next_rv()
            self._remove(rt, key, removed)
            return copy.deepcopy(removed)

    def _remove(self, rt: ResourceType, key: ObjectKey, last: dict[str, Any]) -> None:
        """Drop the object for good: DELETED event, CRD unregistration, garbage collection."""
        old = self.objects.pop(key)
        self._emit(rt, "DELETED", last, old)
        uid = last["metadata"]["uid"]
        if rt.key == CRD_KEY:
            self._unregister_crd(last)
        orphan = uid in self._orphaning
        self._orphaning.discard(uid)
        self._collect_dependents(uid, orphan)
        namespace = last["metadata"].get("namespace")
        ns_key = (NAMESPACE_KEY, "", namespace or "")
        if namespace and ns_key in self.objects and self.objects[ns_key]["metadata"].get("deletionTimestamp"):
            self._drain_namespace(namespace)

    def _unregister_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec") or {}
        type_key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
        rt = self.types.get(type_key)
        if rt is None or not rt.is_custom:
            return
        for key in [k for k in self.objects if k[0] == type_key]:
            gone = copy.deepcopy(self.objects[key])
            gone["metadata"]["resourceVersion"] = self._next_rv()
            self._remove(rt, key, gone)
        del self.types[type_key]

    def _collect_dependents(self, owner_uid: str, orphan: bool) -> None:
        live_uids = {o["metadata"]["uid"] for o in self.objects.values()}
        for (type_key, ns, name), obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(r.get("uid") == owner_uid for r in refs):
                continue
            rt = self.types[type_key]
            remaining = [r for r in refs if r.get("uid") != owner_uid]
            if orphan or any(r.get("uid") in live_uids for r in remaining):
                self.update(rt, ns, name, lambda o, rest=remaining: _with_owner_refs(o, rest))
            elif (type_key, ns, name) in self.objects:
                self.delete(rt, ns, name, {"propagationPolicy": "Background"})

    def _drain_namespace(self, namespace: str) -> None:
        """Namespace deletion: delete its contents; release the namespace once it is empty."""
        for (type_key, ns, name), obj in list(self.objects.items()):
            if ns == namespace and (type_key, ns, name) in self.objects and not obj["metadata"].get("deletionTimestamp"):
                self.delete(self.types[type_key], ns, name)
        if not any(ns == namespace for (_, ns, _) in self.objects):
            ns_key = (NAMESPACE_KEY, "", namespace)
            if ns_key in self.objects:
                gone = copy.deepcopy(self.objects[ns_key])
                gone["metadata"]["resourceVersion"] = self._next_rv()
                self._remove(self.types[NAMESPACE_KEY], ns_key, gone)


def _with_owner_refs(obj: dict[str, Any], refs: list[dict[str, Any]]) -> dict[str, Any]:
    obj["metadata"]["ownerReferences"] = refs
    obj["metadata"].pop("resourceVersion", None)
    return obj


def label_matcher(label_selector: str | None, field_selector: str | None, rt: ResourceType):
    """Build an object predicate; raise ApiError 400 on malformed or unsupported selectors."""
    try:
        labels = patching.parse_label_selector(label_selector or "")
        fields = patching.parse_field_selector(field_selector or "")
    except ValueError as e:
        raise ApiError(400, "BadRequest", f"unable to parse requirement: {e}")
    for field, _, _ in fields:
        if rt.is_custom and field not in ("metadata.name", "metadata.namespace"):
            raise ApiError(400, "BadRequest", f'field label not supported: {field}')

    def matches(obj: dict[str, Any]) -> bool:
        return patching.labels_match(obj["metadata"].get("labels") or {}, labels) and \
            patching.fields_match(obj, fields)

    return matches
