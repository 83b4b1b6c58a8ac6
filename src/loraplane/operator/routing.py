"""Pure builders of the routing objects of the Gateway API Inference Extension (GIE), for its endpoint picker.

A LoRABase gets an ``InferencePool`` (inference.networking.k8s.io/v1) selecting its server pods on the OpenAI
port, served by an endpoint picker the user deploys as the Service ``<base>-epp`` (GIE's gRPC port 9002,
fail-closed: no pick, no request). Each validated LoRAAdapter gets an ``InferenceModelRewrite``
(inference.networking.x-k8s.io/v1alpha2) that names its model in that pool: requests for the adapter's name go
to the adapter's name, weight 100, the picker then scoring pods by LoRA affinity from their metrics. Owner
references (the base, the adapter) let the garbage collector remove them. The operator writes them only when
the API serves these kinds (kube.Kube.serves); otherwise it writes nothing.
"""

from __future__ import annotations

from loraplane.operator.builders import OPENAI_PORT, labels, owner_reference, selector

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = f"{POOL_GROUP}/v1"
POOL_PLURAL = "inferencepools"
REWRITE_GROUP = "inference.networking.x-k8s.io"
REWRITE_VERSION = f"{REWRITE_GROUP}/v1alpha2"
REWRITE_PLURAL = "inferencemodelrewrites"
PICKER_PORT = 9002  # the endpoint picker's ext-proc gRPC port (GIE's default)
FULL_WEIGHT = 100
COMPONENT = "routing"


def _labels(base_name: str, **extra: str) -> dict:
    return {**labels(base_name), "app.kubernetes.io/component": COMPONENT, **extra}


def picker_service(base_name: str) -> str:
    """The Service of the base's endpoint picker (deployed by the user, docs/routing.md)."""
    return f"{base_name}-epp"


def build_inference_pool(base: dict) -> dict:
    """The base's pods as one InferencePool, named like the base."""
    name = base["metadata"]["name"]
    return {
        "apiVersion": POOL_VERSION,
        "kind": "InferencePool",
        "metadata": {
            "name": name,
            "namespace": base["metadata"]["namespace"],
            "labels": _labels(name),
            "ownerReferences": [owner_reference(base)],
        },
        "spec": {
            "selector": {"matchLabels": selector(name)},
            "targetPorts": [{"number": OPENAI_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker_service(name),
                "port": {"number": PICKER_PORT},
                "failureMode": "FailClose",
            },
        },
    }


def adapter_owner_reference(adapter: dict) -> dict:
    """Not blocking the adapter's deletion: that would need update on loraadapters/finalizers
    (OwnerReferencesPermissionEnforcement), and a stale rewrite only names a model no pod serves."""
    meta = adapter["metadata"]
    return {
        "apiVersion": adapter["apiVersion"],
        "kind": "LoRAAdapter",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": False,
    }


def build_model_rewrite(adapter: dict, base_name: str) -> dict:
    """The adapter's model name in its base's pool: an exact match on the name, one target, the same name.

    The target is the alias (not ``name@version``): pods label their metrics with adapter names, and the
    picker's LoRA affinity compares those with the model it routes.
    """
    name = adapter["metadata"]["name"]
    return {
        "apiVersion": REWRITE_VERSION,
        "kind": "InferenceModelRewrite",
        "metadata": {
            "name": name,
            "namespace": adapter["metadata"]["namespace"],
            "labels": _labels(base_name, **{"loraplane.dev/adapter": name}),
            "ownerReferences": [adapter_owner_reference(adapter)],
        },
        "spec": {
            "poolRef": {"group": POOL_GROUP, "kind": "InferencePool", "name": base_name},
            "rules": [
                {
                    "matches": [{"model": {"type": "Exact", "value": name}}],
                    "targets": [{"modelRewrite": name, "weight": FULL_WEIGHT}],
                }
            ],
        },
    }
