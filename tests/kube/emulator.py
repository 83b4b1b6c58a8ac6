"""A Kubernetes API emulator for tests: KMock 0.8's handler with a real API server's semantics.

``KubeEmulator`` extends ``kmock.RawHandler`` (served by ``kmock.Server``); its KMock DSL still works
and takes priority, so tests can inject failures (``emu['patch', kmock.resource(...)][:3] << 409``).
Everything the DSL does not answer is served from ``tests.kube.store.Store``.

Emulated:
- discovery: /api (core ``v1``), /api/v1, /apis, /apis/<g>, /apis/<g>/<v>, /version, /healthz;
  built-ins (core, apps, rbac, coordination, events.k8s.io, apiextensions, policy) + CRD-registered types;
- metadata: uid, resourceVersion (one global counter), generation (spec changes only),
  creationTimestamp, generateName; name and label syntax (422 Invalid);
- create 201 / get / list (XList, rv, limit+continue) / PUT / PATCH (merge, JSON incl. ``test``,
  strategic for built-ins) / DELETE (finalizers, deletionTimestamp, propagationPolicy, preconditions)
  / deletecollection; dryRun; Status bodies for 400/404/405/409/410/415/422;
- 409 on stale resourceVersion; PUT of a custom resource without resourceVersion is 422, as real;
- status and scale subresources (CRD specReplicasPath/statusReplicasPath; autoscaling/v1 Scale);
- CRDs: registration with Established/NamesAccepted, unregistration and instance cleanup on delete;
- namespaces (default, kube-system, kube-public exist; objects in a missing namespace are 404;
  deleting a namespace deletes its contents);
- label selectors (=, ==, !=, in, notin, exists, !exists) and field selectors (metadata.name and
  metadata.namespace everywhere; any dotted field for built-ins, e.g. pods' status.phase);
- watch (``watch=true|1``, legacy /watch/ paths): resourceVersion (history replay; absent or "0"
  gives synthetic ADDED), 410 Expired past the bounded history, timeoutSeconds, allowWatchBookmarks,
  sendInitialEvents (initial-events-end bookmark), selectors with ADDED/DELETED on transitions;
- ownerReference garbage collection by uid (background; Orphan honoured; Foreground acts as Background);
- server-side Tables (``Accept: ...;as=Table``) from CRD additionalPrinterColumns (Name + Age otherwise);
- a schema-less /openapi/v3 so kubectl's field validation negotiation works; /openapi/v2 is 404.

Not emulated (knowingly): admission and schema validation (OpenAPI, CEL), defaulting, pruning,
server-side apply (415), protobuf/CBOR bodies (415), conversion between versions, per-field strategic
merge keys other than ``name``, graceful pod termination (pods go at once), authn/authz, controllers
(no ReplicaSets or Pods appear: see ``tests.kube.fixtures.create_pods_for_deployment``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import traceback
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering

from tests.kube import patching
from tests.kube.resources import ResourceType, group_entry, openapi_v3_document, render_table, resource_list
from tests.kube.store import ApiError, Store, Watcher, label_matcher

JSON = "application/json"


@dataclasses.dataclass(slots=True, frozen=True)
class LoggedRequest:
    """One request as the API server saw it (for counting API calls in tests)."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str = ""

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch") in ("true", "1") or "/watch/" in self.path


@dataclasses.dataclass(slots=True)
class Target:
    rt: ResourceType
    version: str
    namespace: str | None
    name: str | None
    subresource: str
    legacy_watch: bool = False


@attrs.define(kw_only=True)
class KubeEmulator(kmock.RawHandler):
    store: Store = attrs.field(factory=Store)
    bookmark_interval: float = 5.0  # seconds between BOOKMARK events on watches that allow them
    log: list[LoggedRequest] = attrs.field(factory=list, init=False)
    _closing: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw.read()
        try:
            request = await rendering.Request._parse(raw, id=len(self._requests))
        except ValueError:  # KMock 0.8's path parser fails on e.g. /api/v1/namespaces
            request = rendering.Request(id=len(self._requests), raw_request=raw, url=raw.url, method=raw.method,
                                        params=dict(raw.query), headers=dict(raw.headers), body=body,
                                        text=body.decode(errors="replace"))
        self._requests.append(request)
        try:
            return await self._handle(request)
        except Exception as e:  # a 500 with the traceback beats a dropped connection when debugging
            return await self._render_error(e)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        self.log.append(LoggedRequest(raw.method, raw.path, dict(raw.query), raw.headers.get("Content-Type", "")))
        if self._payloads:  # user-defined KMock reactions first: failure injection, overrides
            try:
                return await super()._handle(request)
            except NotImplementedError:
                pass
        try:
            return await self._route(raw, request.body)
        except ApiError as e:
            return aiohttp.web.json_response(e.body(), status=e.code)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, ApiError):
            return aiohttp.web.json_response(exc.body(), status=exc.code)
        error = ApiError(500, "InternalError", repr(exc), {"traceback": traceback.format_exc()})
        return aiohttp.web.json_response(error.body(), status=500)

    def close_watches(self) -> None:
        self._closing.set()

    # --- routing -------------------------------------------------------------------------------

    async def _route(self, raw: aiohttp.web.BaseRequest, body: bytes) -> aiohttp.web.StreamResponse:
        parts = [p for p in raw.path.split("/") if p]
        method = raw.method
        if method == "GET" and len(parts) <= 3 and (found := self._discovery(raw, parts)) is not None:
            return found
        if parts[:2] == ["openapi", "v3"] and method == "GET":
            return self._openapi(parts[2:])
        target = self._parse_target(parts)
        query = raw.query
        watching = target.legacy_watch or query.get("watch") in ("true", "1")
        if method == "GET" and watching:
            return await self._watch(raw, target)
        if method == "GET":
            return self._get(raw, target)
        payload = _parse_json(body) if body else None
        dry_run = query.get("dryRun") == "All"
        if method == "POST" and target.name is None:
            return self._create(target, payload, dry_run)
        if method == "DELETE":
            return self._delete(target, payload, dict(query), dry_run)
        if target.name is None:
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on the requested resource")
        if method == "PUT":
            return self._replace(target, payload, dry_run)
        if method == "PATCH":
            content_type = raw.headers.get("Content-Type", "").split(";")[0].strip()
            return self._patch(target, content_type, payload, dry_run)
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    def _discovery(self, raw: aiohttp.web.BaseRequest, parts: list[str]) -> aiohttp.web.Response | None:
        types = list(self.store.types.values())
        if not parts:
            paths = ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/readyz", "/version", "/openapi/v3"]
            paths += sorted({f"/apis/{rt.group}/{v}" for rt in types if rt.group for v in rt.versions})
            return _json({"paths": paths})
        if parts in (["healthz"], ["livez"], ["readyz"]):
            return aiohttp.web.Response(text="ok")
        if parts == ["version"]:
            return _json({"major": "1", "minor": "37", "gitVersion": "v1.37.0-kmock", "platform": "linux/amd64"})
        if parts == ["api"]:
            return _json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{raw.host}"}]})
        if parts == ["api", "v1"]:
            return _json(resource_list("", "v1", [rt for rt in types if rt.group == ""]))
        if parts == ["apis"]:
            groups: dict[str, list[str]] = {}
            for rt in types:
                if rt.group:
                    groups.setdefault(rt.group, [])
                    groups[rt.group] += [v for v in rt.versions if v not in groups[rt.group]]
            return _json({"kind": "APIGroupList", "apiVersion": "v1",
                          "groups": [group_entry(g, vs) for g, vs in sorted(groups.items())]})
        if parts[0] == "apis" and len(parts) == 2:
            versions = [v for rt in types if rt.group == parts[1] for v in rt.versions]
            if not versions:
                raise _not_found_url()
            return _json({"kind": "APIGroup", "apiVersion": "v1", **group_entry(parts[1], list(dict.fromkeys(versions)))})
        if parts[0] == "apis" and len(parts) == 3:
            served = [rt for rt in types if rt.group == parts[1] and parts[2] in rt.versions]
            if not served:
                raise _not_found_url()
            return _json(resource_list(parts[1], parts[2], served))
        return None

    def _openapi(self, rest: list[str]) -> aiohttp.web.Response:
        types = list(self.store.types.values())
        gvs = sorted({(rt.group, v) for rt in types for v in rt.versions})
        if not rest:
            def url(g: str, v: str) -> str:
                return f"apis/{g}/{v}" if g else f"api/{v}"
            stamp = str(self.store.resource_version)
            return _json({"paths": {url(g, v): {"serverRelativeURL": f"/openapi/v3/{url(g, v)}?hash={stamp}"}
                                    for g, v in gvs}})
        group, version = ("", rest[1]) if rest[0] == "api" and len(rest) == 2 else \
            (rest[1], rest[2]) if rest[0] == "apis" and len(rest) == 3 else (None, None)
        served = [rt for rt in types if rt.group == group and version in rt.versions]
        if not served:
            raise _not_found_url()
        return _json(openapi_v3_document(group or "", version or "", served))

    def _parse_target(self, parts: list[str]) -> Target:
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 4:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise _not_found_url()
        legacy_watch = rest[:1] == ["watch"]
        rest = rest[1:] if legacy_watch else rest
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise _not_found_url()
        rt = self.store.find_type(group, version, rest[0])
        if rt is None or (namespace is not None and not rt.namespaced):
            raise _not_found_url()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else ""
        if rt.namespaced and name is not None and namespace is None:
            raise _not_found_url()
        if sub not in ("", "status", "scale", "finalize") or (sub == "status" and not rt.status_subresource) \
                or (sub == "scale" and rt.scale is None):
            raise _not_found_url()
        return Target(rt, version, namespace, name, sub, legacy_watch)

    # --- verbs ---------------------------------------------------------------------------------

    def _get(self, raw: aiohttp.web.BaseRequest, target: Target) -> aiohttp.web.Response:
        rt, query = target.rt, raw.query
        wants_table = "as=Table" in raw.headers.get("Accept", "")
        if target.name is not None:
            obj = self.store.get(rt, target.namespace or "", target.name)
            if target.subresource == "scale":
                return _json(_to_scale(rt, obj))
            obj = _versioned(rt, target.version, obj)
            if wants_table:
                return _json(_table(rt, [obj], obj["metadata"]["resourceVersion"], query))
            return _json(obj)
        matches = label_matcher(query.get("labelSelector"), query.get("fieldSelector"), rt)
        items, rv = self.store.list(rt, target.namespace, matches)
        items = [_versioned(rt, target.version, o) for o in items]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0)
        page = items[start:start + limit] if limit else items[start:]
        more = bool(limit) and start + limit < len(items)
        if wants_table:
            return _json(_table(rt, page, str(rv), query))
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if more:
            meta["continue"] = str(start + limit)
            meta["remainingItemCount"] = len(items) - start - limit
        return _json({"kind": f"{rt.kind}List", "apiVersion": rt.api_version(target.version),
                      "metadata": meta, "items": page})

    def _create(self, target: Target, payload: Any, dry_run: bool) -> aiohttp.web.Response:
        if not isinstance(payload, dict):
            raise ApiError(400, "BadRequest", "the body of the request must be a JSON object")
        if target.rt.namespaced and target.namespace is None:
            raise _not_found_url()
        obj = self.store.create(target.rt, target.namespace or "", payload, dry_run)
        return _json(_versioned(target.rt, target.version, obj), status=201)

    def _replace(self, target: Target, payload: Any, dry_run: bool) -> aiohttp.web.Response:
        if not isinstance(payload, dict):
            raise ApiError(400, "BadRequest", "the body of the request must be a JSON object")
        assert target.name is not None
        if target.subresource == "scale":
            return self._write_scale(target, lambda scale: payload, dry_run)
        obj = self.store.update(target.rt, target.namespace or "", target.name, lambda current: payload,
                                target.subresource, dry_run, require_rv=target.rt.is_custom)
        return _json(_versioned(target.rt, target.version, obj))

    def _patch(self, target: Target, content_type: str, payload: Any, dry_run: bool) -> aiohttp.web.Response:
        assert target.name is not None
        rt = target.rt
        if content_type == "application/json-patch+json":
            apply = patching.json_patch
        elif content_type == "application/merge-patch+json":
            apply = patching.merge_patch
        elif content_type == "application/strategic-merge-patch+json" and not rt.is_custom:
            apply = patching.strategic_merge_patch
        else:
            accepted = "application/json-patch+json, application/merge-patch+json"
            if not rt.is_custom:
                accepted += ", application/strategic-merge-patch+json"
            raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                           f"accepted media types include: {accepted} (server-side apply is not emulated)")

        def change(current: dict[str, Any]) -> dict[str, Any]:
            try:
                return apply(current, payload)
            except patching.PatchError as e:
                if e.conflict:
                    raise ApiError.conflict(rt, target.name or "", str(e)) from e
                raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: {e}")

        if target.subresource == "scale":
            return self._write_scale(target, change, dry_run)
        obj = self.store.update(rt, target.namespace or "", target.name, change, target.subresource, dry_run)
        return _json(_versioned(rt, target.version, obj))

    def _write_scale(self, target: Target, change, dry_run: bool) -> aiohttp.web.Response:
        rt, spec = target.rt, target.rt.scale
        assert spec is not None and target.name is not None

        def to_object(current: dict[str, Any]) -> dict[str, Any]:
            scale = change(_to_scale(rt, current))
            replicas = (scale.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise ApiError.invalid(rt, target.name or "", "spec.replicas", "must be a non-negative integer")
            _set_path(current, spec.spec_replicas_path, replicas)
            current["metadata"]["resourceVersion"] = (scale.get("metadata") or {}).get("resourceVersion") or \
                current["metadata"]["resourceVersion"]
            return current

        obj = self.store.update(rt, target.namespace or "", target.name, to_object, "", dry_run)
        return _json(_to_scale(rt, obj))

    def _delete(self, target: Target, payload: Any, query: dict[str, str], dry_run: bool) -> aiohttp.web.Response:
        options = dict(payload) if isinstance(payload, dict) else {}
        if "propagationPolicy" in query:
            options["propagationPolicy"] = query["propagationPolicy"]
        dry_run = dry_run or "All" in (options.get("dryRun") or [])
        rt, namespace = target.rt, target.namespace or ""
        if target.name is not None:
            obj = self.store.delete(rt, namespace, target.name, options, dry_run)
            return _json(_versioned(rt, target.version, obj))
        matches = label_matcher(query.get("labelSelector"), query.get("fieldSelector"), rt)
        items, _ = self.store.list(rt, target.namespace, matches)
        deleted = [self.store.delete(rt, o["metadata"].get("namespace", ""), o["metadata"]["name"], options, dry_run)
                   for o in items]
        return _json({"kind": f"{rt.kind}List", "apiVersion": rt.api_version(target.version),
                      "metadata": {"resourceVersion": str(self.store.resource_version)},
                      "items": [_versioned(rt, target.version, o) for o in deleted]})

    # --- watch ---------------------------------------------------------------------------------

    async def _watch(self, raw: aiohttp.web.BaseRequest, target: Target) -> aiohttp.web.StreamResponse:
        rt, query = target.rt, raw.query
        field_selector = query.get("fieldSelector") or ""
        if target.name is not None:  # the deprecated single-object watch
            field_selector = ",".join(filter(None, [field_selector, f"metadata.name={target.name}"]))
        matches = label_matcher(query.get("labelSelector"), field_selector, rt)
        rv_text = query.get("resourceVersion") or ""
        since = None if rv_text in ("", "0") or query.get("sendInitialEvents") == "true" else _parse_rv(rv_text)
        queue: asyncio.Queue = asyncio.Queue()
        watcher = Watcher(rt.key, target.namespace, matches, asyncio.get_running_loop(), queue)
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        bookmarks = query.get("allowWatchBookmarks") == "true"
        wants_table = "as=Table" in raw.headers.get("Accept", "")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": JSON})
        try:
            backlog = self.store.subscribe(watcher, since)
        except ApiError as e:  # the real server answers 200 and streams the Status as an ERROR event
            await response.prepare(raw)
            await response.write(json.dumps({"type": "ERROR", "object": e.body()}).encode() + b"\n")
            await response.write_eof()
            return response
        try:
            response.enable_chunked_encoding()
            await response.prepare(raw)

            async def send(type_: str, obj: dict[str, Any]) -> None:
                body = _versioned(rt, target.version, obj) if type_ != "BOOKMARK" else obj
                if wants_table and type_ != "BOOKMARK":
                    body = _table(rt, [body], body["metadata"]["resourceVersion"], query)
                await response.write(json.dumps({"type": type_, "object": body}).encode() + b"\n")

            for type_, obj in backlog:
                await send(type_, obj)
            if query.get("sendInitialEvents") == "true" and bookmarks:
                await send("BOOKMARK", self._bookmark(rt, target, initial_end=True))
            await self._pump(queue, send, raw, rt, target, timeout, bookmarks)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError, aiohttp.ClientConnectionResetError):
            pass
        finally:
            self.store.unsubscribe(watcher)
        return response

    async def _pump(self, queue, send, raw, rt, target, timeout, bookmarks) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        next_bookmark = time.monotonic() + self.bookmark_interval
        while not self._closing.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            if bookmarks and now >= next_bookmark:
                await send("BOOKMARK", self._bookmark(rt, target))
                next_bookmark = now + self.bookmark_interval
            wait = min(0.5, *(t - now for t in (deadline, next_bookmark if bookmarks else None) if t is not None))
            try:
                type_, obj = await asyncio.wait_for(queue.get(), timeout=max(wait, 0.001))
            except TimeoutError:
                if raw.transport is None or raw.transport.is_closing():
                    return
                continue
            await send(type_, obj)

    def _bookmark(self, rt: ResourceType, target: Target, initial_end: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"resourceVersion": str(self.store.resource_version)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"kind": rt.kind, "apiVersion": rt.api_version(target.version), "metadata": meta}


# --- helpers -----------------------------------------------------------------------------------


def _json(data: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(body=json.dumps(data).encode(), status=status, content_type=JSON)


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as e:
        raise ApiError(415, "UnsupportedMediaType", f"the body is not JSON (protobuf/CBOR are not emulated): {e}")


def _parse_rv(text: str) -> int:
    if not text.isdigit():
        raise ApiError(400, "BadRequest", f'resourceVersion: Invalid value: "{text}": must be an integer')
    return int(text)


def _not_found_url() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


def _versioned(rt: ResourceType, version: str, obj: dict[str, Any]) -> dict[str, Any]:
    obj["apiVersion"], obj["kind"] = rt.api_version(version), rt.kind
    return obj


def _table(rt: ResourceType, objects: list[dict[str, Any]], rv: str, query) -> dict[str, Any]:
    table = render_table(rt, objects, rv)
    if query.get("includeObject") == "Object":
        for row, obj in zip(table["rows"], objects, strict=True):
            row["object"] = obj
    elif query.get("includeObject") == "None":
        for row in table["rows"]:
            row.pop("object", None)
    return table


def _get_path(obj: Any, path: str) -> Any:
    for part in path.strip(".").split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.strip(".").split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value


def _to_scale(rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    spec = rt.scale
    assert spec is not None
    meta = obj["metadata"]
    selector = _get_path(obj, spec.label_selector_path) if spec.label_selector_path else None
    if isinstance(selector, dict):  # a LabelSelector object (apps/v1) becomes its string form
        selector = ",".join(f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items())
    status: dict[str, Any] = {"replicas": _get_path(obj, spec.status_replicas_path) or 0}
    if selector:
        status["selector"] = selector
    return {
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                     if k in meta},
        "spec": {"replicas": _get_path(obj, spec.spec_replicas_path) or 0},
        "status": status,
    }
