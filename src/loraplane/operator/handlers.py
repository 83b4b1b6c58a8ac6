"""kopf registrations, kept thin: indexes, one daemon per object, wake-ups, the deletion finalizer.

Each LoRABase and LoRAAdapter gets a daemon that runs a reconcile pass, then sleeps until its
timeout (drift check, poll or backoff) or until an event concerns it: its own spec changed
(generation), a pod of its base changed, or its base changed. Status writes never wake anyone,
so there is no hot loop. Pods and bases are read from kopf's in-memory indexes (filled by watches),
not by API calls per pass.
"""

from __future__ import annotations

import copy
import logging
import time

import kopf

from loraplane.operator import readiness_gate, reconcile_adapter, reconcile_base
from loraplane.operator.builders import BASE_LABEL
from loraplane.operator.crd_models import ADAPTER_PLURAL, BASE_PLURAL, GROUP, VERSION
from loraplane.operator.kube import custom_ref
from loraplane.operator.pods import pod_info, serving_pods

FINALIZER = "loraplane.dev/finalizer"
FINALIZER_WAIT = 30.0  # seconds a new adapter's first pass waits for kopf's finalizer
BASE, ADAPTER = "LoRABase", "LoRAAdapter"


def make_settings(
    *, standalone: bool = False, peering: str | None = None, scanning: bool = False
) -> kopf.OperatorSettings:
    """kopf settings. ``scanning`` (cluster-wide mode) watches CRDs and namespaces, which needs a ClusterRole;
    namespaced mode discovers the resources once at startup and needs none."""
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = not scanning
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.loraplane.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kopf.loraplane.dev")
    settings.posting.level = (
        logging.WARNING
    )  # our own Events are explicit (publish.py); kopf's: problems only
    settings.posting.reporting_component = "loraplane-operator"
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.peering.standalone = standalone
    if peering:
        settings.peering.name = peering
    return settings


def own_copy(body) -> dict:
    """A pass's own copy of the object, without ``metadata.managedFields`` (never read; at thousands of
    adapters, copying it on every pass was a large part of the operator's CPU)."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    return copy.deepcopy({**{k: v for k, v in body.items() if k != "metadata"}, "metadata": meta})


def _first(store):
    return next(iter(store or ()), None)


def _base_of(adapter: dict) -> str:
    return ((adapter.get("spec") or {}).get("baseRef") or {}).get("name", "")


# --- operator lifecycle ------------------------------------------------------------------------------
@kopf.on.login()
def login(memo: kopf.Memo, **_) -> kopf.ConnectionInfo:
    """The same explicit configuration the kubernetes client uses (never $KUBECONFIG behind our back)."""
    config = memo.ctx.kube.api.configuration
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


@kopf.on.startup()
async def startup(memo: kopf.Memo, **_) -> None:
    memo.ctx.start()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    await memo.ctx.stop()


# --- indexes: the operator's view of pods, bases and adapters, kept current by watches --------------
@kopf.index("pods", labels={BASE_LABEL: kopf.PRESENT})
def server_pods(namespace, labels, body, **_):
    return {(namespace, labels[BASE_LABEL]): pod_info(body)}


@kopf.index(GROUP, VERSION, BASE_PLURAL)
def lorabases(namespace, name, body, **_):
    return {(namespace, name): copy.deepcopy(dict(body))}


@kopf.index(GROUP, VERSION, ADAPTER_PLURAL)
def adapters_by_base(namespace, name, body, **_):
    return {(namespace, _base_of(body)): name}


@kopf.index(GROUP, VERSION, ADAPTER_PLURAL)
def adapter_gate_entries(namespace, name, body, **_):
    """What a base's pods' readiness gates wait for (readiness_gate.py): placement and whether it is served."""
    return {(namespace, _base_of(body)): readiness_gate.adapter_entry(name, body)}


# --- wake-ups ----------------------------------------------------------------------------------------
def _spec_changed(body) -> bool:
    """A generation not yet observed (deleting an object bumps it too: that is the finalizer's business)."""
    meta = body.get("metadata") or {}
    observed = (body.get("status") or {}).get("observedGeneration")
    return meta.get("generation") != observed and not meta.get("deletionTimestamp")


@kopf.on.event(GROUP, VERSION, ADAPTER_PLURAL)
def adapter_event(type, body, namespace, name, memo, **_):
    if type == "DELETED":
        memo.ctx.forget((ADAPTER, namespace, name), custom_ref(ADAPTER_PLURAL, namespace, name).path())
    elif _spec_changed(body):
        memo.ctx.wake((ADAPTER, namespace, name))


@kopf.on.event(GROUP, VERSION, BASE_PLURAL)
def base_event(type, body, namespace, name, memo, adapters_by_base, **_):
    ctx = memo.ctx
    if type == "DELETED":
        ctx.forget((BASE, namespace, name), custom_ref(BASE_PLURAL, namespace, name).path())
    elif _spec_changed(body):
        ctx.wake((BASE, namespace, name))
    status = body.get("status") or {}
    fingerprint = None if type == "DELETED" else (
        body["metadata"].get("generation"), status.get("readyReplicas"), status.get("observedBaseHash"))  # fmt: skip
    if ctx.fingerprints.changed((namespace, name), fingerprint):
        for adapter in adapters_by_base.get((namespace, name), ()):
            ctx.wake((ADAPTER, namespace, adapter))


@kopf.on.event("pods", labels={BASE_LABEL: kopf.PRESENT})
def pod_event(type, body, namespace, name, labels, memo, adapters_by_base, **_):
    if not pod_matters(memo.ctx, type, body, namespace, name):
        return
    base = labels[BASE_LABEL]
    memo.ctx.wake((BASE, namespace, base))
    for adapter in adapters_by_base.get((namespace, base), ()):
        memo.ctx.wake((ADAPTER, namespace, adapter))


def pod_matters(ctx, type, body, namespace: str, name: str) -> bool:
    """Whether a pod's event changes what any pass reads of it (its ``PodInfo``). A pod's life brings a dozen
    events (scheduling, container statuses, probes' timestamps); each of those woke every adapter of the base,
    so a replaced pod cost hundreds of passes whose allocations alone raised the operator's memory floor."""
    key = (namespace, name)
    if type == "DELETED":  # its listing is never asked for again
        ctx.snapshots.drop_if(lambda address: address.name == name)
        ctx.pod_prints.forget(key)
        return True
    return ctx.pod_prints.changed(key, pod_info(body))


# --- the reconcile loops -----------------------------------------------------------------------------
async def _reconcile_loop(ctx, key, path: str, body, stopped, logger, one_pass) -> None:
    """One object's daemon, for either kind: a pass over its newest version, then sleep until due or woken."""
    while not stopped:
        obj = ctx.echo.newest(path, own_copy(body))
        try:
            delay = await one_pass(obj)
            ctx.failures.reset((key, "error"))
        except Exception as exc:  # a pass failed (API error, ...): log, back off, try again
            logger.warning(f"reconcile failed: {type(exc).__name__}: {exc}")
            delay = ctx.backoff((key, "error"), True)
        await ctx.sleep(key, delay, stopped)


@kopf.daemon(GROUP, VERSION, BASE_PLURAL, cancellation_timeout=10)
async def base_daemon(stopped, body, namespace, name, memo, server_pods, adapter_gate_entries, logger, **_):
    ctx = memo.ctx

    async def one_pass(base: dict) -> float:
        pods = list(server_pods.get((namespace, name), ()))
        adapters = list(adapter_gate_entries.get((namespace, name), ()))
        return await reconcile_base.reconcile(ctx, base, pods, adapters)

    path = custom_ref(BASE_PLURAL, namespace, name).path()
    await _reconcile_loop(ctx, (BASE, namespace, name), path, body, stopped, logger, one_pass)


def _awaits_finalizer(adapter: dict, started: float) -> bool:
    """kopf adds its finalizer with a JSON patch that tests the resourceVersion: a status write of ours in
    between makes it fail and start over (at thousands of new adapters, hundreds of times). So a new adapter's
    first pass waits for the finalizer, up to FINALIZER_WAIT seconds (its watch event wakes the daemon)."""
    meta = adapter["metadata"]
    if FINALIZER in (meta.get("finalizers") or ()):
        return False
    return time.monotonic() - started < FINALIZER_WAIT


# The short initial delay lets kopf add its finalizer before our first status write (fewer conflicts).
@kopf.daemon(GROUP, VERSION, ADAPTER_PLURAL, cancellation_timeout=10, initial_delay=0.5)
async def adapter_daemon(stopped, body, namespace, name, memo, lorabases, server_pods, logger, **_):
    ctx = memo.ctx
    started = time.monotonic()

    async def one_pass(adapter: dict) -> float:
        if adapter["metadata"].get("deletionTimestamp"):  # the finalizer unloads it: a pass now could load
            return ctx.tunables.drift_interval  # it again, and its status write would race kopf's patch
        if _awaits_finalizer(adapter, started):
            return 1.0
        base_name = _base_of(adapter)
        base = _first(lorabases.get((namespace, base_name)))
        pods = serving_pods(server_pods.get((namespace, base_name), ()), ctx.tunables.admin_port)
        return await reconcile_adapter.reconcile(ctx, adapter, base, pods)

    path = custom_ref(ADAPTER_PLURAL, namespace, name).path()
    await _reconcile_loop(ctx, (ADAPTER, namespace, name), path, body, stopped, logger, one_pass)


@kopf.on.delete(GROUP, VERSION, ADAPTER_PLURAL)
async def adapter_deleted(body, namespace, name, memo, lorabases, server_pods, **_):
    """The finalizer: unload from every pod, or hold (and say why in status and Events) and retry."""
    ctx = memo.ctx
    base_name = _base_of(body)
    base = _first(lorabases.get((namespace, base_name)))
    pods = serving_pods(server_pods.get((namespace, base_name), ()), ctx.tunables.admin_port)
    failures = await reconcile_adapter.finalize(ctx, copy.deepcopy(dict(body)), base, pods)
    if failures:
        detail = "; ".join(f"{f.pod}: {f.reason}" for f in failures)
        delay = min(ctx.tunables.retry_delay, ctx.tunables.max_retry_delay)
        raise kopf.TemporaryError(f"unload failed on {len(failures)} pod(s): {detail}", delay=delay)
