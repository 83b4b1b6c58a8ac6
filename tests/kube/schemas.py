"""Structural-schema handling of custom resources, in the API server's order: prune, default, validate.

- pruning drops fields the CRD's openAPIV3Schema does not declare (unless a node has
  ``x-kubernetes-preserve-unknown-fields``), as a real cluster silently does;
- defaulting fills ``default:`` values of missing properties under existing objects;
- validation checks types, required, enum, pattern, bounds, lengths and items (jsonschema, Draft 4
  rules as OpenAPI 3.0 uses them; ``nullable`` and ``x-kubernetes-int-or-string`` honoured).
  CEL rules (``x-kubernetes-validations``), formats and validation ratcheting are not emulated.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema

_ROOT_KEYS = ("apiVersion", "kind", "metadata")


def prune_and_default(obj: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Return a pruned and defaulted copy; ``apiVersion``, ``kind`` and ``metadata`` stay untouched."""
    body = {k: v for k, v in obj.items() if k not in _ROOT_KEYS}
    root_schema = {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items()
                                            if k not in _ROOT_KEYS}}  # fmt: skip
    result = _walk(body, root_schema)
    return {**{k: obj[k] for k in _ROOT_KEYS if k in obj}, **result}


def _walk(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
            "x-kubernetes-embedded-resource"
        )
        result: dict[str, Any] = {}
        for key, child in value.items():
            if properties is not None and key in properties:
                result[key] = _walk(child, properties[key])
            elif isinstance(additional, dict):
                result[key] = _walk(child, additional)
            elif keep_unknown or (properties is None and additional in (None, True)):
                result[key] = child
        for key, child_schema in (properties or {}).items():
            if key not in result and "default" in child_schema:
                result[key] = _walk(copy.deepcopy(child_schema["default"]), child_schema)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_walk(item, schema["items"]) for item in value]
    return value


def validation_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Field errors as the API server words them: ``spec.replicas: Invalid value: ...``."""
    body = {k: v for k, v in obj.items() if k not in _ROOT_KEYS}
    errors = []
    found = _validator(schema).iter_errors(body)
    for error in sorted(found, key=lambda e: [str(p) for p in e.absolute_path]):
        path = ".".join(str(p) for p in error.absolute_path)
        if error.validator == "required":
            missing = error.message.split("'")[1] if "'" in error.message else "?"
            errors.append(f"{'.'.join(filter(None, [path, missing]))}: Required value")
        else:
            errors.append(f"{path or '<root>'}: Invalid value: {error.instance!r}: {error.message}")
    return errors


_validators: dict[int, tuple[dict[str, Any], jsonschema.Draft4Validator]] = {}


def _validator(schema: dict[str, Any]) -> jsonschema.Draft4Validator:
    """Compile once per CRD schema object (kept alive here, so its id is not reused)."""
    cached = _validators.get(id(schema))
    if cached is None or cached[0] is not schema:
        properties = {k: v for k, v in (schema.get("properties") or {}).items() if k not in _ROOT_KEYS}
        required = [r for r in schema.get("required") or [] if r not in _ROOT_KEYS]
        root = {**schema, "properties": properties, "required": required}
        if not required:
            root.pop("required")  # Draft 4 wants a non-empty list
        cached = _validators[id(schema)] = (schema, jsonschema.Draft4Validator(_to_json_schema(root)))
    return cached[1]


def _to_json_schema(schema: Any) -> Any:
    """OpenAPI 3.0 (Kubernetes flavour) to JSON Schema Draft 4."""
    if isinstance(schema, list):
        return [_to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: _to_json_schema(v)
        for k, v in schema.items()
        if not k.startswith("x-kubernetes-") and k != "default"
    }
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    out.pop("nullable", None)
    out.pop("format", None)  # formats are advisory in jsonschema; the server checks few of them
    return out
