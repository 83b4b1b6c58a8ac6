"""A tiny OpenAPI v3 vocabulary for CRD schemas: every helper demands a description."""

from __future__ import annotations

from loraplane.operator import crd_models as M


def obj(
    description: str, properties: dict, required: tuple[str, ...] = (), rules: tuple = (), **extra
) -> dict:
    schema = {"type": "object", "description": description, "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    if rules:
        schema["x-kubernetes-validations"] = [{"rule": rule, "message": message} for rule, message in rules]
    return schema


def string(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


def integer(description: str, minimum: int, maximum: int, **extra) -> dict:
    return {"type": "integer", "description": description, "minimum": minimum, "maximum": maximum, **extra}


def number(description: str, minimum: float, maximum: float, **extra) -> dict:
    return {"type": "number", "description": description, "minimum": minimum, "maximum": maximum, **extra}


def boolean(description: str, **extra) -> dict:
    return {"type": "boolean", "description": description, **extra}


def array(description: str, items: dict, **extra) -> dict:
    return {"type": "array", "description": description, "items": items, **extra}


def free_form(description: str) -> dict:
    """A Kubernetes core type passed through to the pod spec unchanged (tolerations, affinity)."""
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def name(description: str) -> dict:
    return string(description, pattern=M.NAME_PATTERN, maxLength=63)


def secret_ref(description: str, *keys: tuple[str, str, str]) -> dict:
    props = {"name": name("Name of a Secret in this namespace. The operator reads it by name only.")}
    for key, default, what in keys:
        props[key] = string(what, default=default, maxLength=253)
    return obj(description, props, required=("name",))


def quantity(description: str, default: str) -> dict:
    return string(description, pattern=M.QUANTITY_PATTERN, default=default)


def conditions() -> dict:
    condition = obj(
        "A condition, per the Kubernetes API conventions.",
        {
            "type": string("Condition type, for example Ready."),
            "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": string("A CamelCase reason (documented in docs/operator.md)."),
            "message": string("Human-readable detail."),
            "observedGeneration": integer("metadata.generation this condition was computed for.", 0, 2**62),
            "lastTransitionTime": string("When status last changed.", format="date-time"),
        },
        required=("type", "status"),
    )
    return array(
        "Current state, one entry per type.",
        condition,
        **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
