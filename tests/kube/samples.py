"""A sample CRD (status + scale subresources, printer columns) for the emulator's own tests."""

from __future__ import annotations

from typing import Any

GROUP, VERSION, PLURAL, KIND = "example.dev", "v1", "widgets", "Widget"
API_VERSION = f"{GROUP}/{VERSION}"


def widget_crd(scope: str = "Namespaced") -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {"plural": PLURAL, "singular": "widget", "kind": KIND, "shortNames": ["wd"]},
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                        },
                    },
                    "additionalPrinterColumns": [
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                        },
                        {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


def widget(name: str, size: int = 1, namespace: str = "default", **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, **meta},
        "spec": {"size": size, "replicas": 1},
    }


def gadget_crd() -> dict[str, Any]:
    """A CRD with a structural schema: pruning, defaults and validation apply to its objects."""
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["size"],
                "properties": {
                    "size": {"type": "integer", "minimum": 1},
                    "mode": {"type": "string", "enum": ["fast", "slow"], "default": "fast"},
                    "name": {"type": "string", "pattern": "^[a-z0-9-]{1,63}$", "nullable": True},
                    "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
            },
            "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"gadgets.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"},
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                    "selectableFields": [{"jsonPath": ".spec.mode"}],
                }
            ],
        },
    }
