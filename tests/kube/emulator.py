"""A Kubernetes API emulator for tests: KMock 0.8's handler with a real API server's semantics.

``KubeEmulator`` extends ``kmock.RawHandler`` (served by aiohttp's RawTestServer, as ``kmock.Server``
does, minus its process-wide DNS patch); its KMock DSL still works and takes priority, so tests can
inject failures (``emu['patch', kmock.resource(...)][:3] << 409``). Everything the DSL does not answer
is served from ``tests.kube.store.Store``. Run it with ``tests.kube.fixtures`` (fixtures, helpers).

Emulated:
- discovery: /api (core ``v1``), /api/v1, /apis, /apis/<g>, /apis/<g>/<v>, /version, /healthz;
  built-ins (core, apps, rbac, coordination, events.k8s.io, apiextensions, policy) + CRD-registered types;
- metadata: uid, resourceVersion (one global counter), generation (spec changes only),
  creationTimestamp, generateName; name and label syntax (422 Invalid);
- create 201 / get / list (XList, rv, limit+continue) / PUT / PATCH (merge, JSON incl. ``test``,
  strategic for built-ins) / DELETE (finalizers, deletionTimestamp, propagationPolicy, preconditions)
  / deletecollection; dryRun; Status bodies for 400/404/405/409/410/415/422;
- 409 Conflict on a stale resourceVersion (PUT, or a PATCH body carrying one); a failed JSON-patch
  ``test`` op (kopf's resourceVersion guard) is 422 Invalid, as the real server answers and kopf
  expects; PUT of a custom resource without resourceVersion is 422; 409 AlreadyExists on create;
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
- server-side Tables (``Accept: ...;as=Table``) from CRD additionalPrinterColumns, built-in columns
  for pods/deployments/services/namespaces/CRDs, Name + Age otherwise (also on watches);
- what controllers do synchronously (``tests.kube.controllers``): CRD establishment, garbage
  collection, namespace termination, a little defaulting (Secret stringData, Service clusterIP);
- a schema-less /openapi/v3 so kubectl's field validation negotiation works; /openapi/v2 is 404.

Not emulated (knowingly): admission and schema validation (OpenAPI, CEL), most defaulting, pruning,
server-side apply (415), protobuf/CBOR bodies (415), conversion between versions, per-field strategic
merge keys other than ``name``, graceful pod termination (pods go at once), Foreground deletion,
managedFields, authn/authz, workload controllers (no ReplicaSets or Pods appear by themselves: see
``RunningEmulator.create_pods_for_deployment``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import traceback
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering

from tests.kube import patching
from tests.kube.discovery import serve_discovery, serve_openapi
from tests.kube.errors import ApiError, json_response, not_found_url
from tests.kube.resources import ResourceType, set_path, to_scale
from tests.kube.store import Store, label_matcher
from tests.kube.tables import table_for
from tests.kube.watching import WatchRequest, serve_watch


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
        return _truthy(self.query.get("watch")) or "/watch/" in self.path


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
            request = rendering.Request(
                id=len(self._requests),
                raw_request=raw,
                url=raw.url,
                method=raw.method,
                params=dict(raw.query),
                headers=dict(raw.headers),
                body=body,
                text=body.decode(errors="replace"),
            )
        self._requests.append(request)
        try:
            return await self._handle(request)
        except Exception as e:  # a 500 with the traceback beats a dropped connection when debugging
            return await self._render_error(e)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        logged = LoggedRequest(raw.method, raw.path, dict(raw.query), raw.headers.get("Content-Type", ""),
                               request.body)  # fmt: skip
        self.log.append(logged)
        try:
            response = await self._answer(request, raw)
        except Exception as e:  # rendered by __call__ (KMock reactions raise injected errors)
            logged.status = e.code if isinstance(e, ApiError) else 500
            raise
        logged.status = response.status
        return response

    async def _answer(
        self, request: rendering.Request, raw: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
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
        """End every open watch stream (call in the emulator's loop, before stopping the server)."""
        self._closing.set()
        with self.store.lock:
            for watcher in self.store.watchers:
                watcher.queue.put_nowait(None)

    # --- routing -------------------------------------------------------------------------------

    async def _route(self, raw: aiohttp.web.BaseRequest, body: bytes) -> aiohttp.web.StreamResponse:
        parts = [p for p in raw.path.split("/") if p]
        method = raw.method
        if (
            method == "GET"
            and len(parts) <= 3
            and (found := serve_discovery(self.store, raw, parts)) is not None
        ):
            return found
        if parts[:2] == ["openapi", "v3"] and method == "GET":
            return serve_openapi(self.store, parts[2:])
        target = self._parse_target(parts)
        query = raw.query
        watching = target.legacy_watch or _truthy(query.get("watch"))
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
            raise ApiError(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        if method == "PUT":
            return self._replace(target, payload, dry_run)
        if method == "PATCH":
            content_type = raw.headers.get("Content-Type", "").split(";")[0].strip()
            return self._patch(target, content_type, payload, dry_run)
        raise ApiError(
            405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
        )

    def _parse_target(self, parts: list[str]) -> Target:
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
        rt = self.store.find_type(group, version, rest[0])
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

    # --- verbs ---------------------------------------------------------------------------------

    def _get(self, raw: aiohttp.web.BaseRequest, target: Target) -> aiohttp.web.Response:
        rt, query = target.rt, raw.query
        wants_table = "as=Table" in raw.headers.get("Accept", "")
        if target.name is not None:
            obj = self.store.get(rt, target.namespace or "", target.name)
            if target.subresource == "scale":
                return json_response(to_scale(rt, obj))
            obj = _versioned(rt, target.version, obj)
            if wants_table:
                return json_response(table_for(rt, [obj], obj["metadata"]["resourceVersion"], query))
            return json_response(obj)
        matches = label_matcher(query.get("labelSelector"), query.get("fieldSelector"), rt)
        items, rv = self.store.list(rt, target.namespace, matches)
        items = [_versioned(rt, target.version, o) for o in items]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0)
        page = items[start : start + limit] if limit else items[start:]
        more = bool(limit) and start + limit < len(items)
        if wants_table:
            return json_response(table_for(rt, page, str(rv), query))
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if more:
            meta["continue"] = str(start + limit)
            meta["remainingItemCount"] = len(items) - start - limit
        return json_response(
            {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version(target.version),
                "metadata": meta,
                "items": page,
            }
        )

    def _create(self, target: Target, payload: Any, dry_run: bool) -> aiohttp.web.Response:
        if not isinstance(payload, dict):
            raise ApiError(400, "BadRequest", "the body of the request must be a JSON object")
        if target.rt.namespaced and target.namespace is None:
            raise not_found_url()
        obj = self.store.create(target.rt, target.namespace or "", payload, dry_run)
        return json_response(_versioned(target.rt, target.version, obj), status=201)

    def _replace(self, target: Target, payload: Any, dry_run: bool) -> aiohttp.web.Response:
        if not isinstance(payload, dict):
            raise ApiError(400, "BadRequest", "the body of the request must be a JSON object")
        assert target.name is not None
        if target.subresource == "scale":
            return self._write_scale(target, lambda scale: payload, dry_run)
        obj = self.store.update(
            target.rt,
            target.namespace or "",
            target.name,
            lambda current: payload,
            target.subresource,
            dry_run,
            require_rv=target.rt.is_custom,
        )
        return json_response(_versioned(target.rt, target.version, obj))

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
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - "
                f"accepted media types include: {accepted} (server-side apply is not emulated)",
            )

        def change(current: dict[str, Any]) -> dict[str, Any]:
            try:
                return apply(current, payload)
            except patching.PatchError as e:
                # A failed JSON-patch ``test`` (kopf's resourceVersion guard included) is a 422, not a
                # 409: the API server wraps every patch-application error so, and kopf relies on it.
                cause = {"causes": [{"reason": "UnexpectedServerResponse", "message": str(e)}]}
                message = "the server rejected our request due to an error in our request"
                raise ApiError(422, "Invalid", message, cause) from e

        if target.subresource == "scale":
            return self._write_scale(target, change, dry_run)
        obj = self.store.update(rt, target.namespace or "", target.name, change, target.subresource, dry_run)
        return json_response(_versioned(rt, target.version, obj))

    def _write_scale(self, target: Target, change, dry_run: bool) -> aiohttp.web.Response:
        rt, spec = target.rt, target.rt.scale
        assert spec is not None and target.name is not None

        def to_object(current: dict[str, Any]) -> dict[str, Any]:
            scale = change(to_scale(rt, current))
            replicas = (scale.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise ApiError.invalid(
                    rt, target.name or "", "spec.replicas", "must be a non-negative integer"
                )
            set_path(current, spec.spec_replicas_path, replicas)
            current["metadata"]["resourceVersion"] = (scale.get("metadata") or {}).get(
                "resourceVersion"
            ) or current["metadata"]["resourceVersion"]
            return current

        obj = self.store.update(rt, target.namespace or "", target.name, to_object, "", dry_run)
        return json_response(to_scale(rt, obj))

    def _delete(
        self, target: Target, payload: Any, query: dict[str, str], dry_run: bool
    ) -> aiohttp.web.Response:
        options = dict(payload) if isinstance(payload, dict) else {}
        if "propagationPolicy" in query:
            options["propagationPolicy"] = query["propagationPolicy"]
        dry_run = dry_run or "All" in (options.get("dryRun") or [])
        rt, namespace = target.rt, target.namespace or ""
        if target.name is not None:
            obj = self.store.delete(rt, namespace, target.name, options, dry_run)
            gone = not obj["metadata"].get("deletionTimestamp")
            if gone and not rt.is_custom and rt.plural != "pods":  # as the built-in registries answer
                details = {
                    "name": target.name,
                    "group": rt.group,
                    "kind": rt.plural,
                    "uid": obj["metadata"]["uid"],
                }
                return json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                      "details": details})  # fmt: skip
            return json_response(_versioned(rt, target.version, obj))
        matches = label_matcher(query.get("labelSelector"), query.get("fieldSelector"), rt)
        items, _ = self.store.list(rt, target.namespace, matches)
        deleted = [
            self.store.delete(rt, o["metadata"].get("namespace", ""), o["metadata"]["name"], options, dry_run)
            for o in items
        ]
        return json_response(
            {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version(target.version),
                "metadata": {"resourceVersion": str(self.store.resource_version)},
                "items": [_versioned(rt, target.version, o) for o in deleted],
            }
        )

    # --- watch ---------------------------------------------------------------------------------

    async def _watch(self, raw: aiohttp.web.BaseRequest, target: Target) -> aiohttp.web.StreamResponse:
        rt, query = target.rt, raw.query
        field_selector = query.get("fieldSelector") or ""
        if target.name is not None:  # the deprecated single-object watch
            field_selector = ",".join(filter(None, [field_selector, f"metadata.name={target.name}"]))
        rv_text = query.get("resourceVersion") or ""
        initial = _truthy(query.get("sendInitialEvents"))
        request = WatchRequest(
            type_key=rt.key,
            namespace=target.namespace,
            matches=label_matcher(query.get("labelSelector"), field_selector, rt),
            since=None if rv_text in ("", "0") or initial else _parse_rv(rv_text),
            timeout=float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None,
            bookmarks=_truthy(query.get("allowWatchBookmarks")),
            initial_events_end=initial,
            kind=rt.kind,
            api_version=rt.api_version(target.version),
        )
        wants_table = "as=Table" in raw.headers.get("Accept", "")

        def render(type_: str, obj: dict[str, Any]) -> dict[str, Any]:
            obj = _versioned(rt, target.version, obj)
            return table_for(rt, [obj], obj["metadata"]["resourceVersion"], query) if wants_table else obj

        return await serve_watch(raw, self.store, request, render, self._closing, self.bookmark_interval)


# --- helpers -----------------------------------------------------------------------------------


def _truthy(value: str | None) -> bool:
    """Go's strconv.ParseBool, as the API server parses query flags (the Python client sends "True")."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as e:
        raise ApiError(
            415, "UnsupportedMediaType", f"the body is not JSON (protobuf/CBOR are not emulated): {e}"
        ) from e


def _parse_rv(text: str) -> int:
    if not text.isdigit():
        raise ApiError(400, "BadRequest", f'resourceVersion: Invalid value: "{text}": must be an integer')
    return int(text)


def _versioned(rt: ResourceType, version: str, obj: dict[str, Any]) -> dict[str, Any]:
    obj["apiVersion"], obj["kind"] = rt.api_version(version), rt.kind
    return obj
