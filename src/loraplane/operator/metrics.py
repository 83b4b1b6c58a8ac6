"""Prometheus metrics of the operator (served by ``loraplane operator run --metrics-port``)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "loraplane_operator_reconcile_total", "Reconcile passes by kind and result.", ["kind", "result"]
)
RECONCILE_SECONDS = Histogram(
    "loraplane_operator_reconcile_seconds",
    "Duration of one reconcile pass.",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
ADAPTER_STATE = Gauge(
    "loraplane_operator_adapter_state",
    "1 for the state each LoRAAdapter is in (Ready, Progressing, Degraded, Invalid), else 0.",
    ["namespace", "adapter", "state"],
)
ADAPTER_PODS = Gauge(
    "loraplane_operator_adapter_ready_pods", "Pods serving the desired version.", ["namespace", "adapter"]
)
QUIET_CHECKS = Counter(
    "loraplane_operator_quiet_checks_total",
    "Drift checks of a settled LoRAAdapter that only looked at its pods: nothing it reads had changed.",
)
STATES = ("Ready", "Progressing", "Degraded", "Invalid")


@contextmanager
def reconcile_timer(kind: str):
    """Counts the pass; the block sets ``outcome["result"]`` (ok, retry, error) before it exits."""
    outcome = {"result": "error"}
    start = time.perf_counter()
    try:
        yield outcome
    finally:
        RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - start)
        RECONCILES.labels(kind, outcome["result"]).inc()


def set_adapter_state(namespace: str, adapter: str, state: str, ready_pods: int) -> None:
    for candidate in STATES:
        ADAPTER_STATE.labels(namespace, adapter, candidate).set(1.0 if candidate == state else 0.0)
    ADAPTER_PODS.labels(namespace, adapter).set(ready_pods)


def forget_adapter(namespace: str, adapter: str) -> None:
    for candidate in STATES:
        try:
            ADAPTER_STATE.remove(namespace, adapter, candidate)
        except KeyError:
            pass
    try:
        ADAPTER_PODS.remove(namespace, adapter)
    except KeyError:
        pass
