"""A Kubernetes API emulator for tests: KMock 0.8's handler with a real API server's semantics.

``KubeEmulator`` extends ``kmock.RawHandler`` (served by aiohttp's RawTestServer, as ``kmock.Server``
does, minus its process-wide DNS patch); its KMock DSL still works and takes priority, so tests can
inject failures (``emu['patch', kmock.resource(...)][:3] << 409``). Everything the DSL does not answer
is served from ``tests.kube.store.Store``. Run it with ``tests.kube.fixtures`` (fixtures, helpers).

Emulated:
- discovery: /api (core ``v1``), /api/v1, /apis, /apis/<g>, /apis/<g>/<v>, /version, /healthz;
  built-ins (core, apps, rbac, coordination, events.k8s.io, apiextensions, policy, networking,
  autoscaling, batch, scheduling; see ``resources``) + CRD-registered types;
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
  metadata.namespace everywhere, a CRD's selectableFields; any dotted field for built-ins, e.g.
  pods' status.phase);
- watch (``watch=true|1``, legacy /watch/ paths): resourceVersion (history replay; absent or "0"
  gives synthetic ADDED), 410 Expired past the bounded history, timeoutSeconds, allowWatchBookmarks,
  sendInitialEvents (initial-events-end bookmark), selectors with ADDED/DELETED on transitions;
- ownerReference garbage collection by uid (background; Orphan honoured; Foreground acts as Background);
- server-side Tables (``Accept: ...;as=Table``) from CRD additionalPrinterColumns, built-in columns
  for pods/deployments/services/namespaces/CRDs, Name + Age otherwise (also on watches);
- what controllers do synchronously (``tests.kube.controllers``): CRD establishment, garbage
  collection, namespace termination, a little defaulting (Secret stringData, Service clusterIP);
- custom resources pruned, defaulted and validated by their CRD's structural schema (``schemas``);
- /openapi/v3 (CRD schemas included: ``kubectl explain`` works) so kubectl's field validation
  negotiation works; /openapi/v2 is 404;
- server-side apply, approximated (create if absent; three-way merge against the manager's last
  applied config; no managedFields, no conflicts), so ``kubectl apply --server-side`` and helm 3/4
  install/upgrade/uninstall work; protobuf bodies for Namespace, Secret, ConfigMap, ServiceAccount
  and DeleteOptions (``protobuf``), which ``kubectl create <generator>`` and helm send.

Not emulated (knowingly): admission webhooks, CEL rules, validation ratcheting, built-in types'
schemas and defaulting, managedFields/field ownership, protobuf of other kinds and CBOR (415),
conversion between versions, strategic-merge keys other than ``name``, graceful pod termination
(pods go at once), Foreground deletion, authn/authz, workload controllers (no ReplicaSets or Pods
appear by themselves: see ``RunningEmulator.create_pods_for_deployment``).
"""

from __future__ import annotations

import asyncio
import traceback
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering

from tests.kube import patching
from tests.kube.discovery import serve_discovery, serve_openapi
from tests.kube.errors import ApiError, json_response, not_found_url
from tests.kube.patching import merge_patch
from tests.kube.resources import set_path, to_scale
from tests.kube.routing import LoggedRequest, Target, parse_body, parse_rv, parse_target, truthy, versioned
from tests.kube.store import Store, label_matcher
from tests.kube.tables import table_for
from tests.kube.watching import WatchRequest, serve_watch


@attrs.define(kw_only=True)
class KubeEmulator(kmock.RawHandler):
    store: Store = attrs.field(factory=Store)
    bookmark_interval: float = 5.0  # seconds between BOOKMARK events on watches that allow them
    log: list[LoggedRequest] = attrs.field(factory=list, init=False)
    _closing: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw.read()
        request = rendering.Request(id=len(self._requests), raw_request=raw, url=raw.url, method=raw.method,
                                    params=dict(raw.query), headers=dict(raw.headers), body=body)  # fmt: skip
        if self._payloads:  # KMock's full parsing (k8s criteria) is costly: only when reactions need it
            try:
                request = await rendering.Request._parse(raw, id=len(self._requests))
            except ValueError:  # KMock 0.8's path parser fails on e.g. /api/v1/namespaces
                pass
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
        target = parse_target(self.store, parts)
        query = raw.query
        watching = target.legacy_watch or truthy(query.get("watch"))
        if method == "GET" and watching:
            return await self._watch(raw, target)
        if method == "GET":
            return self._get(raw, target)
        content_type = raw.headers.get("Content-Type", "").split(";")[0].strip()
        payload = parse_body(body, content_type) if body else None
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
        if method == "PATCH" and content_type == "application/apply-patch+yaml":
            return self._server_side_apply(target, payload, query.get("fieldManager", ""), dry_run)
        if method == "PATCH":
            return self._patch(target, content_type, payload, dry_run)
        raise ApiError(
            405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
        )

    # --- verbs ---------------------------------------------------------------------------------

    def _get(self, raw: aiohttp.web.BaseRequest, target: Target) -> aiohttp.web.Response:
        rt, query = target.rt, raw.query
        wants_table = "as=Table" in raw.headers.get("Accept", "")
        if target.name is not None:
            obj = self.store.get(rt, target.namespace or "", target.name)
            if target.subresource == "scale":
                return json_response(to_scale(rt, obj))
            obj = versioned(rt, target.version, obj)
            if wants_table:
                return json_response(table_for(rt, [obj], obj["metadata"]["resourceVersion"], query))
            return json_response(obj)
        matches = label_matcher(query.get("labelSelector"), query.get("fieldSelector"), rt)
        items, rv = self.store.list(rt, target.namespace, matches)
        items = [versioned(rt, target.version, o) for o in items]
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
        return json_response(versioned(target.rt, target.version, obj), status=201)

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
        return json_response(versioned(target.rt, target.version, obj))

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
            accepted += ", application/apply-patch+yaml"
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include: {accepted}",
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
        return json_response(versioned(rt, target.version, obj))

    def _server_side_apply(
        self, target: Target, config: Any, manager: str, dry_run: bool
    ) -> aiohttp.web.Response:
        """Server-side apply, approximated: create if absent, else a three-way merge against what this
        field manager applied last (fields it dropped are removed). No managedFields, no conflicts."""
        rt, namespace, name = target.rt, target.namespace or "", target.name
        assert name is not None
        if not isinstance(config, dict):
            raise ApiError(400, "BadRequest", "the applied configuration must be an object")
        if not manager:
            raise ApiError(400, "BadRequest", "PATCH with an apply patch requires a fieldManager")
        try:
            current = self.store.get(rt, namespace, name)
        except ApiError as e:
            if e.code != 404 or target.subresource:
                raise
            body = merge_patch({}, config) | {"metadata": {**config.get("metadata", {}), "name": name}}
            obj = self.store.create(rt, namespace, body, dry_run)
            if not dry_run:
                self.store.applied[(obj["metadata"]["uid"], manager)] = config
            return json_response(versioned(rt, target.version, obj), status=201)
        key = (current["metadata"]["uid"], manager)
        patch = patching.three_way_patch(self.store.applied.get(key, {}), config)
        merge = patching.merge_patch if rt.is_custom else patching.strategic_merge_patch
        obj = self.store.update(
            rt, namespace, name, lambda cur: merge(cur, patch), target.subresource, dry_run
        )
        if not dry_run:
            self.store.applied[key] = config
        return json_response(versioned(rt, target.version, obj))

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
            return json_response(versioned(rt, target.version, obj))
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
                "items": [versioned(rt, target.version, o) for o in deleted],
            }
        )

    # --- watch ---------------------------------------------------------------------------------

    async def _watch(self, raw: aiohttp.web.BaseRequest, target: Target) -> aiohttp.web.StreamResponse:
        rt, query = target.rt, raw.query
        field_selector = query.get("fieldSelector") or ""
        if target.name is not None:  # the deprecated single-object watch
            field_selector = ",".join(filter(None, [field_selector, f"metadata.name={target.name}"]))
        rv_text = query.get("resourceVersion") or ""
        initial = truthy(query.get("sendInitialEvents"))
        request = WatchRequest(
            type_key=rt.key,
            namespace=target.namespace,
            matches=label_matcher(query.get("labelSelector"), field_selector, rt),
            since=None if rv_text in ("", "0") or initial else parse_rv(rv_text),
            timeout=float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None,
            bookmarks=truthy(query.get("allowWatchBookmarks")),
            initial_events_end=initial,
            kind=rt.kind,
            api_version=rt.api_version(target.version),
        )
        wants_table = "as=Table" in raw.headers.get("Accept", "")

        def render(type_: str, obj: dict[str, Any]) -> dict[str, Any]:
            obj = versioned(rt, target.version, obj)
            return table_for(rt, [obj], obj["metadata"]["resourceVersion"], query) if wants_table else obj

        return await serve_watch(raw, self.store, request, render, self._closing, self.bookmark_interval)
