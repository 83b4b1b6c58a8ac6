"""The emulator's object store: API-server semantics over plain dicts, safe to call from any thread.

Every mutation takes one lock, bumps one global resourceVersion counter, appends to a bounded event
history and pushes the event to live watchers (each watcher belongs to an asyncio loop; events are
delivered with ``call_soon_threadsafe``). Objects of a type are stored once, whatever the version.
"""

from __future__ import annotations

import collections
import random
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

from tests.kube import patching, schemas
from tests.kube.controllers import CRD_KEY, NAMESPACE_KEY, Controllers, fold_string_data
from tests.kube.errors import ApiError, now_rfc3339
from tests.kube.patching import clone
from tests.kube.resources import ResourceType, builtin_types
from tests.kube.watching import Event, Watcher

ObjectKey = tuple[tuple[str, str], str, str]  # ((group, plural), namespace or "", name)
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME_RE = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


def _generation_relevant(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


_random = random.Random()
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the API server's generateName alphabet (no vowels)


def random_suffix(length: int = 5) -> str:
    return "".join(_random.choices(_SUFFIX_ALPHABET, k=length))


class Store(Controllers):
    def __init__(self, history_limit: int = 5000, schema_checks: bool = True) -> None:
        self.schema_checks = schema_checks  # prune/default/validate custom resources by their CRD schema
        self.lock = threading.RLock()
        self.types: dict[tuple[str, str], ResourceType] = {rt.key: rt for rt in builtin_types()}
        self.objects: dict[ObjectKey, dict[str, Any]] = {}
        self.history: collections.deque[Event] = collections.deque(maxlen=history_limit)
        self.history_truncated = False
        self.watchers: list[Watcher] = []
        self._rv = 0
        self._orphaning: set[str] = set()  # uids deleted with propagationPolicy=Orphan
        self.applied: dict[tuple[str, str], dict[str, Any]] = {}  # (uid, field manager) -> applied config
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
            return clone(obj)

    def list(
        self, rt: ResourceType, namespace: str | None, matches: Callable[[dict], bool]
    ) -> tuple[list, int]:
        with self.lock:
            items = [
                clone(obj)
                for (key, ns, _), obj in self.objects.items()
                if key == rt.key and (namespace is None or ns == namespace) and matches(obj)
            ]
            return sorted(
                items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])
            ), self._rv

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
        event = Event(int(obj["metadata"]["resourceVersion"]), rt.key, type_, clone(obj), old)
        self.history.append(event)
        for watcher in list(self.watchers):
            watcher.offer(event)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    # --- create --------------------------------------------------------------------------------

    def create(self, rt: ResourceType, namespace: str, body: dict[str, Any], dry_run: bool = False) -> dict:
        obj = clone(body)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "BadRequest", "metadata must be an object")
        with self.lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + random_suffix()
            name = meta.get("name") or ""
            self._validate_meta(rt, obj, name)
            if rt.namespaced:
                if meta.get("namespace", namespace) != namespace:
                    raise ApiError(
                        400,
                        "BadRequest",
                        "the namespace of the provided object does not match "
                        "the namespace sent on the request",
                    )
                if (NAMESPACE_KEY, "", namespace) not in self.objects:
                    raise ApiError.not_found(self.types[NAMESPACE_KEY], namespace)
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            key = (rt.key, namespace if rt.namespaced else "", name)
            if key in self.objects:
                raise ApiError.already_exists(rt, name)
            for field in ("resourceVersion", "uid", "deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(field, None)
            meta["uid"] = str(uuid.UUID(int=_random.getrandbits(128), version=4))  # os.urandom is slow here
            meta["creationTimestamp"] = now_rfc3339()
            meta.pop("generation", None)
            if rt.tracks_generation:
                meta["generation"] = 1
            obj["kind"], obj["apiVersion"] = rt.kind, rt.api_version(rt.versions[0])
            if rt.status_subresource:
                obj.pop("status", None)
            self._on_create_defaults(rt, obj, dry_run)
            obj = self._structural(rt, obj, name)
            if dry_run:
                return obj
            obj["metadata"]["resourceVersion"] = self._next_rv()
            self.objects[key] = obj
            self._emit(rt, "ADDED", obj, None)
            self._collect_if_owners_absent(rt, key[1], name)
            return clone(obj)

    def _structural(self, rt: ResourceType, obj: dict[str, Any], name: str) -> dict[str, Any]:
        """Custom resources: prune, default and validate against the CRD's schema, as admission does."""
        schema = rt.schemas.get(rt.versions[0]) if rt.is_custom and self.schema_checks else None
        if not schema:
            return obj
        obj = schemas.prune_and_default(obj, schema)
        errors = schemas.validation_errors(obj, schema)
        if errors:
            listed = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
            causes = [{"reason": "FieldValueInvalid", "message": e, "field": e.split(":")[0]} for e in errors]
            raise ApiError(422, "Invalid", f'{rt.kind}.{rt.group} "{name}" is invalid: {listed}',
                           {"name": name, "group": rt.group, "kind": rt.kind, "causes": causes})  # fmt: skip
        return obj

    def _validate_meta(self, rt: ResourceType, obj: dict[str, Any], name: str) -> None:
        if not name:
            raise ApiError.invalid(
                rt, name, "metadata.name", "Required value: name or generateName is required"
            )
        if len(name) > 253 or not _NAME_RE.match(name):
            raise ApiError.invalid(
                rt,
                name,
                "metadata.name",
                f'Invalid value: "{name}": a lowercase RFC 1123 '
                "subdomain must consist of lower case alphanumeric characters, '-' or '.'",
            )
        for key, value in (obj["metadata"].get("labels") or {}).items():
            if (
                not _LABEL_NAME_RE.match(key)
                or not isinstance(value, str)
                or len(value) > 63
                or not _LABEL_VALUE_RE.match(value)
            ):
                raise ApiError.invalid(rt, name, f"metadata.labels[{key}]", f'Invalid value: "{value}"')

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
            candidate = change(clone(current))
            if not isinstance(candidate, dict):
                raise ApiError(400, "BadRequest", "the patched object is not a JSON object")
            meta = candidate.setdefault("metadata", {})
            given_rv = meta.get("resourceVersion")
            if require_rv and not given_rv:
                raise ApiError.invalid(
                    rt,
                    name,
                    "metadata.resourceVersion",
                    "Invalid value: 0x0: must be specified for an update",
                )
            if given_rv and given_rv != current["metadata"]["resourceVersion"]:
                raise ApiError.conflict(rt, name)
            if meta.get("name", name) != name:
                raise ApiError(
                    400,
                    "BadRequest",
                    f"the name of the object ({meta.get('name')}) does not match "
                    f"the name on the URL ({name})",
                )
            new = self._merge_by_subresource(rt, current, candidate, subresource)
            if rt.key == ("", "secrets"):
                fold_string_data(new)
            self._validate_meta(rt, new, name)
            new = self._structural(rt, new, name)
            if new == current:
                return clone(current)  # a no-op write keeps the resourceVersion, as the API does
            if rt.tracks_generation and _generation_relevant(new) != _generation_relevant(current):
                new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            if rt.key == CRD_KEY and subresource == "":
                self._register_crd(new, dry_run)
            if dry_run:
                return new
            new["metadata"]["resourceVersion"] = self._next_rv()
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                self._remove(rt, key, new)
            else:
                self.objects[key] = new
                self._emit(rt, "MODIFIED", new, current)
                if new["metadata"].get("ownerReferences") != current["metadata"].get("ownerReferences"):
                    self._collect_if_owners_absent(rt, namespace, name)
            return clone(new)

    def _merge_by_subresource(self, rt: ResourceType, current: dict, candidate: dict, sub: str) -> dict:
        if sub == "status":
            new = clone(current)
            if "status" in candidate:
                new["status"] = candidate["status"]
            else:
                new.pop("status", None)
            return new
        new = candidate
        if rt.status_subresource:
            if "status" in current:
                new["status"] = clone(current["status"])
            else:
                new.pop("status", None)
        new["kind"], new["apiVersion"] = current["kind"], current["apiVersion"]
        meta, old_meta = new["metadata"], current["metadata"]
        for field in (
            "uid",
            "creationTimestamp",
            "namespace",
            "generation",
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "name",
        ):
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise ApiError(
                    422,
                    "Invalid",
                    f"metadata.finalizers: Forbidden: no new finalizers can be added "
                    f"if the object is being deleted, found new finalizers {sorted(added)}",
                )
        for field in ("finalizers", "labels", "annotations", "ownerReferences"):
            if field in meta and not meta[field]:
                del meta[field]
        return new

    # --- delete --------------------------------------------------------------------------------

    def delete(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        options: dict[str, Any] | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        options = options or {}
        with self.lock:
            key = (rt.key, namespace, name)
            current = self.objects.get(key)
            if current is None:
                raise ApiError.not_found(rt, name)
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != current["metadata"]["uid"]:
                raise ApiError.conflict(
                    rt,
                    name,
                    f"Precondition failed: UID in precondition: {pre['uid']}, "
                    f"UID in object meta: {current['metadata']['uid']}",
                )
            if (
                pre.get("resourceVersion")
                and pre["resourceVersion"] != current["metadata"]["resourceVersion"]
            ):
                raise ApiError.conflict(rt, name)
            if dry_run:
                return clone(current)
            if options.get("propagationPolicy") == "Orphan":
                self._orphaning.add(current["metadata"]["uid"])
            if current["metadata"].get("deletionTimestamp"):
                return clone(current)
            if current["metadata"].get("finalizers") or rt.key == NAMESPACE_KEY:
                new = clone(current)
                new["metadata"]["deletionTimestamp"] = now_rfc3339()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                if rt.tracks_generation:
                    new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
                new["metadata"]["resourceVersion"] = self._next_rv()
                if rt.key == NAMESPACE_KEY:
                    new["status"] = {"phase": "Terminating"}
                self.objects[key] = new
                self._emit(rt, "MODIFIED", new, current)
                if rt.key == NAMESPACE_KEY:
                    self._drain_namespace(name)
                return clone(self.objects.get(key, new))
            removed = clone(current)
            removed["metadata"]["resourceVersion"] = self._next_rv()
            self._remove(rt, key, removed)
            return clone(removed)

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


def label_matcher(label_selector: str | None, field_selector: str | None, rt: ResourceType):
    """Build an object predicate; raise ApiError 400 on malformed or unsupported selectors."""
    try:
        labels = patching.parse_label_selector(label_selector or "")
        fields = patching.parse_field_selector(field_selector or "")
    except ValueError as e:
        raise ApiError(400, "BadRequest", f"unable to parse requirement: {e}") from e
    for field, _, _ in fields:
        if rt.is_custom and field not in ("metadata.name", "metadata.namespace", *rt.selectable_fields):
            raise ApiError(400, "BadRequest", f"field label not supported: {field}")

    def matches(obj: dict[str, Any]) -> bool:
        return patching.labels_match(obj["metadata"].get("labels") or {}, labels) and patching.fields_match(
            obj, fields
        )

    return matches
