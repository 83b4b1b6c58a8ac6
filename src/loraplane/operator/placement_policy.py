"""Where a LoRABase's pods may run, and as whom: the operator's allow-lists for the pod placement fields.

A LoRABase's pods are created by the ReplicaSet controller, not by whoever wrote the LoRABase, so each
placement field would otherwise lend that writer the cluster's reach: tolerating a taint that reserves
nodes for someone else, steering pods onto nodes by label (next to another tenant's workloads), preempting
with a high PriorityClass, running as a ServiceAccount that carries cloud credentials, or choosing a
RuntimeClass. Each field is allowed only as far as an operator setting says (``loraplane operator run``
flags; the chart's ``operator.policy``); a bare operator allows none of them:

- ``spec.tolerations``: each toleration's ``key`` among ``--allowed-toleration`` (a toleration without a
  key tolerates every taint and is always refused);
- ``spec.nodeSelector`` and ``spec.affinity.nodeAffinity``: each label key (and ``matchFields`` key) among
  ``--allowed-node-label``;
- ``spec.affinity.podAffinity`` / ``podAntiAffinity``: only towards pods of the LoRABase's own namespace
  (no ``namespaces`` or ``namespaceSelector``);
- ``spec.priorityClassName``, ``spec.serviceAccountName``, ``spec.runtimeClassName``: among
  ``--allowed-priority-class``, ``--allowed-service-account``, ``--allowed-runtime-class``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

PLACEMENT_NOT_ALLOWED = "PlacementNotAllowed"

# A qualified label key ([DNS subdomain/]name) and a DNS subdomain (PriorityClass, RuntimeClass, ServiceAccount).
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_NODE_AFFINITY = (
    "requiredDuringSchedulingIgnoredDuringExecution",
    "preferredDuringSchedulingIgnoredDuringExecution",
)
_POD_AFFINITIES = ("podAffinity", "podAntiAffinity")

# Flag and chart value of each allow-list, for the messages.
FLAGS = {
    "tolerations": ("--allowed-toleration", "operator.policy.allowedTolerations"),
    "node_labels": ("--allowed-node-label", "operator.policy.allowedNodeLabels"),
    "priority_classes": ("--allowed-priority-class", "operator.policy.allowedPriorityClasses"),
    "service_accounts": ("--allowed-service-account", "operator.policy.allowedServiceAccounts"),
    "runtime_classes": ("--allowed-runtime-class", "operator.policy.allowedRuntimeClasses"),
}


def checked_entries(kind: str, entries) -> tuple[str, ...]:
    """An allow-list from its flag's values: stripped, malformed entries refused (ValueError names the flag)."""
    pattern = _LABEL_KEY if kind in ("tolerations", "node_labels") else _SUBDOMAIN
    cleaned = tuple(e.strip() for e in entries if e.strip())
    bad = [e for e in cleaned if not pattern.match(e)]
    if bad:
        raise ValueError(f"{FLAGS[kind][0]}: {bad!r} is not a valid {kind.replace('_', ' ')[:-1]} name")
    return cleaned


def _allowed(kind: str, allowed: tuple[str, ...]) -> str:
    flag, value = FLAGS[kind]
    return f"the operator allows {list(allowed)} ({value}, {flag})"


def violations(spec: dict, allow: dict[str, tuple[str, ...]]) -> Iterator[tuple[str, str]]:
    """(field, message) for each placement field of a raw LoRABase ``spec`` that ``allow`` does not allow."""
    for i, toleration in enumerate(spec.get("tolerations") or []):
        key = (toleration or {}).get("key")
        if not key:
            yield f"spec.tolerations[{i}].key", "a toleration without a key tolerates every taint"
        elif key not in allow["tolerations"]:
            yield f"spec.tolerations[{i}].key", f"{key!r}: {_allowed('tolerations', allow['tolerations'])}"
    for key in spec.get("nodeSelector") or {}:
        if key not in allow["node_labels"]:
            yield f"spec.nodeSelector.{key}", f"{key!r}: {_allowed('node_labels', allow['node_labels'])}"
    yield from _affinity(spec.get("affinity") or {}, allow["node_labels"])
    for field_, kind in (("priorityClassName", "priority_classes"), ("serviceAccountName", "service_accounts"),
                         ("runtimeClassName", "runtime_classes")):  # fmt: skip
        name = spec.get(field_)
        if name and name not in allow[kind]:
            yield f"spec.{field_}", f"{name!r}: {_allowed(kind, allow[kind])}"


def _affinity(affinity: dict, node_labels: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    known = ("nodeAffinity", *_POD_AFFINITIES)
    for key in affinity:
        if key not in known:
            yield f"spec.affinity.{key}", f"unknown affinity (expected one of {list(known)})"
    for field_, term in _node_terms(affinity.get("nodeAffinity") or {}):
        for part in ("matchExpressions", "matchFields"):
            for j, requirement in enumerate(term.get(part) or []):
                key = (requirement or {}).get("key")
                if key not in node_labels:
                    yield (f"{field_}.{part}[{j}].key",
                           f"{key!r}: {_allowed('node_labels', node_labels)}")  # fmt: skip
    for kind in _POD_AFFINITIES:
        for field_, term in _pod_terms(kind, affinity.get(kind) or {}):
            for scope in ("namespaces", "namespaceSelector"):
                if term.get(scope) is not None:
                    yield (
                        f"{field_}.{scope}",
                        "pod affinity may only name pods of the LoRABase's own namespace",
                    )


def _node_terms(node: dict) -> Iterator[tuple[str, dict]]:
    """(field, node selector term) of every node affinity term, required and preferred."""
    prefix = "spec.affinity.nodeAffinity"
    required = (node.get(_NODE_AFFINITY[0]) or {}).get("nodeSelectorTerms") or []
    for i, term in enumerate(required):
        yield f"{prefix}.{_NODE_AFFINITY[0]}.nodeSelectorTerms[{i}]", term or {}
    for i, weighted in enumerate(node.get(_NODE_AFFINITY[1]) or []):
        yield f"{prefix}.{_NODE_AFFINITY[1]}[{i}].preference", (weighted or {}).get("preference") or {}


def _pod_terms(kind: str, pod: dict) -> Iterator[tuple[str, dict]]:
    """(field, pod affinity term) of every term of ``podAffinity`` or ``podAntiAffinity``."""
    prefix = f"spec.affinity.{kind}"
    for i, term in enumerate(pod.get(_NODE_AFFINITY[0]) or []):
        yield f"{prefix}.{_NODE_AFFINITY[0]}[{i}]", term or {}
    for i, weighted in enumerate(pod.get(_NODE_AFFINITY[1]) or []):
        yield (
            f"{prefix}.{_NODE_AFFINITY[1]}[{i}].podAffinityTerm",
            (weighted or {}).get("podAffinityTerm") or {},
        )
