"""pydantic ``model_json_schema()`` -> a Kubernetes structural schema (a CRD's openAPIV3Schema).

Kubernetes accepts a subset of OpenAPI v3 (the "structural schema"): every node has a type, no
``$ref``, no ``anyOf``/``oneOf`` outside value validations, no ``additionalProperties`` beside
``properties``. So the generator:
  - inlines every ``$ref`` (field keys such as ``description`` win over the referenced model's);
  - turns ``X | None`` into ``X``: absence is how an API object says None (and the API server prunes
    an explicit null where the schema is not nullable);
  - turns ``dict[str, Any]`` (``additionalProperties: true``) into ``x-kubernetes-preserve-unknown-fields``,
    the only free-form nodes; drops ``additionalProperties: false`` (unknown fields are pruned instead);
  - drops pydantic's ``title``s and ``default: null``; keeps ``x-kubernetes-*`` keys from
    ``json_schema_extra`` (CEL rules, list types);
  - writes keys in one order, so the YAML is byte-stable;
and refuses anything else it cannot express (a real union), rather than emit a schema the API server rejects.
"""

from __future__ import annotations

from pydantic import BaseModel

# The order of keys in every node (then anything else, sorted).
ORDER = (
    "type", "description", "format", "enum", "pattern", "minLength", "maxLength", "minimum", "maximum",
    "maxItems", "default", "nullable", "items", "properties", "additionalProperties", "required",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
    "x-kubernetes-validations",
)  # fmt: skip
DROPPED = ("title",)
RULE_ORDER = ("rule", "message", "fieldPath", "reason", "messageExpression")


class SchemaError(ValueError):
    """The model uses something a structural schema cannot express; ``path`` says where."""


def structural(model: type[BaseModel]) -> dict:
    """The structural schema of ``model`` (with camelCase aliases)."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs = schema.pop("$defs", {})
    return _node(schema, defs, model.__name__)


def _node(node: dict, defs: dict, path: str) -> dict:
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise SchemaError(f"{path}: a union of {len(branches)} types has no structural schema")
        if node.get("default", ...) is None:
            del node["default"]
        resolved = _node(branches[0], defs, path)
        node = {**resolved, **node, "description": node.get("description", resolved.get("description"))}
        if node["description"] is None:
            del node["description"]
    for key in ("oneOf", "allOf", "not", "$ref", "anyOf"):
        if key in node:
            raise SchemaError(f"{path}: {key} has no structural schema here")
    for key in DROPPED:
        node.pop(key, None)
    if "description" in node:  # docstrings wrap; the API's descriptions are one paragraph
        node["description"] = " ".join(node["description"].split())
    if "x-kubernetes-validations" in node:
        node["x-kubernetes-validations"] = [
            {k: rule[k] for k in RULE_ORDER if k in rule} for rule in node["x-kubernetes-validations"]
        ]
    if "properties" in node:
        node["properties"] = {k: _node(v, defs, f"{path}.{k}") for k, v in node["properties"].items()}
    if "items" in node:
        node["items"] = _node(node["items"], defs, f"{path}[]")
    extra = node.pop("additionalProperties", None)
    if extra is True or extra == {}:
        node["x-kubernetes-preserve-unknown-fields"] = True
    elif isinstance(extra, dict):
        node["additionalProperties"] = _node(extra, defs, f"{path}{{}}")
    if node.get("type") == "object" and "properties" in node and not node.get("default", True):
        del node["default"]  # an empty default ({}) of a section: Kubernetes needs none
    if "type" not in node:
        raise SchemaError(f"{path}: no type")
    return {k: node[k] for k in ORDER if k in node} | {k: node[k] for k in sorted(node) if k not in ORDER}
