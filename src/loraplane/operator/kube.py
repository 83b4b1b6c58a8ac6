"""The one module that talks to the Kubernetes API (the official ``kubernetes`` client, sync, in threads).

Objects are plain dicts (``call_api`` with ``response_type="object"``), so one code path serves core,
apps and custom resources. Writes are level-based and idempotent: ``apply`` creates what is missing,
leaves alone what already holds the desired fields, and otherwise replaces with the resourceVersion
it read, re-reading and re-applying on 409. Status goes through the status subresource as a JSON merge
patch: the operator never writes spec.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import copy
import functools
import logging
import time
from dataclasses import dataclass

import kubernetes
from kubernetes.client.exceptions import ApiException

from loraplane.operator.caches import Expiring
from loraplane.operator.crd_models import API_VERSION, BASE_PLURAL
from loraplane.operator.event_lane import EVENT_BACKLOG, EVENT_THREADS, EVENT_TIMEOUT, EventLane, event_body

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
CONFLICT_RETRIES = 8
# API calls in flight at once: the client blocks a thread per call. The threads are the Kube's own, so its
# calls never queue behind slow work (S3 reads) in the event loop's default pool of cores + 4 threads.
# Few, because each keeps a TLS connection alive and the API server closes idle ones: a burst after a quiet
# spell (every adapter's status write when a server pod is replaced) reconnects every thread's connection,
# and such handshake bursts raised RSS for good. With the kubernetes client alone, 40 bursts on fresh
# connections from the third on: +2.1 MiB (16 threads), +1.1 (8), +0.25 (4); +0.27 with 16 threads whose
# connections stay open (e2e/soak/tlsprobe.py, e2e/soak/results/memprobe/tls-bursts.json).
API_THREADS = 4
API_TIMEOUT = 30.0  # seconds one call may take
SECRET_TTL = 30.0  # seconds a Secret read is reused: a rotated Secret is seen within this


@dataclass(frozen=True, slots=True)
class Ref:
    """Where an object lives in the API: ``/api/v1`` or ``/apis/<group>/<version>``, plural, namespace, name."""

    prefix: str
    plural: str
    namespace: str
    name: str = ""

    def path(self, sub: str = "") -> str:
        base = f"{self.prefix}/namespaces/{self.namespace}/{self.plural}"
        return base + (f"/{self.name}" if self.name else "") + (f"/{sub}" if sub else "")


def ref_of(obj: dict) -> Ref:
    api_version, kind = obj["apiVersion"], obj["kind"]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    plural = {"LoRABase": BASE_PLURAL}.get(kind) or kind.lower() + "s"
    return Ref(prefix, plural, obj["metadata"]["namespace"], obj["metadata"]["name"])


def base_ref(namespace: str, name: str = "") -> Ref:
    return Ref(f"/apis/{API_VERSION}", BASE_PLURAL, namespace, name)


def custom_ref(plural: str, namespace: str, name: str = "") -> Ref:
    return Ref(f"/apis/{API_VERSION}", plural, namespace, name)


def is_subset(want, have) -> bool:
    """Does ``have`` already hold every field of ``want``? (The server adds defaults; those do not count.)"""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return want == have


class Kube:
    """Async facade over one ``kubernetes.client.ApiClient`` (built from an explicit configuration)."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        discovery_ttl: float = 60.0,
        event_threads: int = EVENT_THREADS,
        event_backlog: int = EVENT_BACKLOG,
    ):
        self.api = api
        self._secrets: Expiring[tuple[str, str], tuple[dict, dict]] = Expiring()
        self._discovery: dict[str, tuple[float, frozenset[str]]] = {}  # group/version -> (when, plurals)
        self.discovery_ttl = discovery_ttl
        self._threads = concurrent.futures.ThreadPoolExecutor(API_THREADS, thread_name_prefix="kube")
        # Events have threads of their own: a burst of them never holds up a status patch (event_lane.py)
        self.events = EventLane(self._post_event, event_threads, event_backlog)

    # --- raw calls ---------------------------------------------------------------------------------
    def _call(
        self,
        method: str,
        path: str,
        body=None,
        query: list | None = None,
        content_type: str | None = None,
        timeout: float = API_TIMEOUT,
    ):
        headers = {"Accept": "application/json"}
        if content_type or body is not None:
            headers["Content-Type"] = content_type or "application/json"
        return self.api.call_api(
            path,
            method,
            query_params=query or [],
            header_params=headers,
            body=body,
            response_types_map={200: "object", 201: "object", 202: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _request_timeout=timeout,
        )

    async def call(self, method: str, path: str, body=None, query=None, content_type=None):
        call = functools.partial(self._call, method, path, body, query, content_type)
        return await asyncio.get_running_loop().run_in_executor(self._threads, call)

    # --- reads -------------------------------------------------------------------------------------
    async def get(self, ref: Ref) -> dict | None:
        try:
            return await self.call("GET", ref.path())
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, ref: Ref, label_selector: str | None = None) -> list[dict]:
        query = [("labelSelector", label_selector)] if label_selector else []
        return (await self.call("GET", ref.path(), query=query)).get("items", [])

    async def serves(self, api_version: str, plural: str) -> bool:
        """Does the API serve ``plural`` in ``group/version`` (API discovery, remembered ``discovery_ttl`` s)?
        An optional integration's CRDs may come and go: absent is an answer, not an error."""
        cached = self._discovery.get(api_version)
        if cached is None or time.monotonic() - cached[0] >= self.discovery_ttl:
            try:
                found = await self.call("GET", f"/apis/{api_version}")
                plurals = frozenset(r["name"] for r in (found or {}).get("resources", []))
            except ApiException as exc:
                if exc.status not in (403, 404):
                    raise
                plurals = frozenset()
            cached = self._discovery[api_version] = (time.monotonic(), plurals)
        return plural in cached[1]

    async def secret_data(self, namespace: str, name: str, ttl: float = SECRET_TTL) -> dict[str, str] | None:
        """A Secret's decoded data, read by name (never listed), reused ``ttl`` s; None if absent."""
        secret = await self.secret(namespace, name, ttl)
        return None if secret is None else secret[1]

    async def secret(
        self, namespace: str, name: str, ttl: float = SECRET_TTL
    ) -> tuple[dict[str, str], dict[str, str]] | None:
        """(labels, decoded data) of a Secret, read by name (never listed: the operator may not list or watch
        Secrets), reused ``ttl`` s, one GET however many ask at once; None if absent."""
        return await self._secrets.get((namespace, name), ttl, lambda: self._read_secret(namespace, name))

    def forget_secret(self, namespace: str, name: str) -> None:
        """A sign that the Secret changed (a pod refused its token): the next ask reads it again."""
        self._secrets.forget((namespace, name))

    async def _read_secret(self, namespace: str, name: str) -> tuple[dict[str, str], dict[str, str]] | None:
        secret = await self.get(Ref("/api/v1", "secrets", namespace, name))
        if secret is None:
            return None
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        data.update(secret.get("stringData") or {})
        labels = dict((secret.get("metadata") or {}).get("labels") or {})
        return labels, data

    # --- writes ------------------------------------------------------------------------------------
    async def create_if_absent(self, obj: dict) -> bool:
        """Create ``obj`` unless it exists (the admin token: never overwritten). True when created."""
        ref = ref_of(obj)
        if await self.get(ref) is not None:
            return False
        try:
            await self.call("POST", Ref(ref.prefix, ref.plural, ref.namespace).path(), body=obj)
            return True
        except ApiException as exc:
            if exc.status == 409:  # someone else created it first: same outcome
                return False
            raise

    async def apply(self, desired: dict, adopt: bool = True) -> str:
        """Make the object hold ``desired``'s fields: "created", "updated" or "unchanged". ``adopt=False``: an
        existing object that ``desired``'s controller does not own is left alone ("foreign")."""
        ref = ref_of(desired)
        for _ in range(CONFLICT_RETRIES):
            existing = await self.get(ref)
            try:
                if existing is None:
                    await self.call("POST", Ref(ref.prefix, ref.plural, ref.namespace).path(), body=desired)
                    return "created"
                if not adopt and not _same_controller(existing, desired):
                    return "foreign"
                managed = {k: desired[k] for k in ("spec", "data") if k in desired}
                managed["metadata"] = {k: desired["metadata"][k] for k in ("labels", "ownerReferences")}
                if is_subset(managed, existing):
                    return "unchanged"
                await self.call("PUT", ref.path(), body=_replaced(existing, desired))
                return "updated"
            except ApiException as exc:
                if exc.status != 409:
                    raise
                log.debug("conflict applying %s, re-reading", ref.path())
        raise RuntimeError(f"{ref.path()}: still conflicting after {CONFLICT_RETRIES} attempts")

    async def patch_status(self, ref: Ref, status: dict, content_type: str = MERGE_PATCH) -> dict | None:
        """Merge-patch ``status`` (no resourceVersion: the operator is the only status writer of its own
        objects; a pod's conditions take a strategic merge patch, which merges them by type). None if gone."""
        try:
            return await self.call(
                "PATCH", ref.path("status"), body={"status": status}, content_type=content_type
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # --- Events ------------------------------------------------------------------------------------
    async def event(self, obj: dict, type_: str, reason: str, message: str) -> bool:
        """Post a core/v1 Event about ``obj`` now, in the Event lane's threads, through this client's pool of
        kept-alive connections. (kopf's ``kopf.event`` posts each through a connector without a limit: a
        burst of Events, as when a replaced pod makes every adapter write its status, opened a TLS
        connection each, and the heap kept the high-water mark of their buffers.) An Event is auxiliary: a
        failure to post it is logged, never raised. True when posted."""
        return await self.events.send(event_body(obj, type_, reason, message))

    def post_event(self, obj: dict, type_: str, reason: str, message: str) -> None:
        """``event`` in the background, through the Event lane's bounded backlog: the pass that posts it
        does not wait for the API server, and a slow API server costs dropped Events, not stalled passes."""
        self.events.submit(event_body(obj, type_, reason, message))

    def _post_event(self, body: dict) -> None:
        path = f"/api/v1/namespaces/{body['metadata']['namespace']}/events"
        self._call("POST", path, body=body, timeout=EVENT_TIMEOUT)


def _same_controller(existing: dict, desired: dict) -> bool:
    def controller(obj: dict) -> str | None:
        refs = (obj.get("metadata") or {}).get("ownerReferences") or []
        return next((r.get("uid") for r in refs if r.get("controller")), None)

    return controller(existing) is not None and controller(existing) == controller(desired)


def _replaced(existing: dict, desired: dict) -> dict:
    """``existing`` with our fields replaced: spec (or Secret data), our labels, our ownerReferences."""
    body = copy.deepcopy(existing)
    meta = body.setdefault("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), **desired["metadata"]["labels"]}
    meta["ownerReferences"] = desired["metadata"]["ownerReferences"]
    if "data" in desired:
        body["data"] = desired["data"]
    if "spec" in desired:
        if desired["kind"] == "Service":  # keep what the API server allocated (clusterIP, ...)
            body["spec"] = {**(body.get("spec") or {}), **desired["spec"]}
        else:
            body["spec"] = desired["spec"]
    body.pop("status", None)
    return body


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> kubernetes.client.ApiClient:
    """An ApiClient from an explicit kubeconfig file, or in-cluster config when none is given."""
    configuration = kubernetes.client.Configuration()
    if kubeconfig:
        kubernetes.config.load_kube_config(
            config_file=kubeconfig, context=context, client_configuration=configuration
        )
    else:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = API_THREADS + EVENT_THREADS  # a connection per thread, kept alive
    return kubernetes.client.ApiClient(configuration)
