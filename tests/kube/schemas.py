"""Structural-schema handling of custom resources, in the API server's order: prune, default, validate.

- pruning drops fields the CRD's openAPIV3Schema does not declare (unless a node has
  ``x-kubernetes-preserve-unknown-fields``), and nulls of non-nullable fields, as a cluster silently does;
- defaulting fills ``default:`` values of missing properties under existing objects;
- validation checks type, required, enum, pattern, bounds, lengths, item and property counts,
  allOf/anyOf/oneOf and ``x-kubernetes-int-or-string``, with the API server's error wording.
  CEL rules (``x-kubernetes-validations``), formats and validation ratcheting are not emulated.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from tests.kube.patching import clone

_ROOT_KEYS = ("apiVersion", "kind", "metadata")


def prune_and_default(obj: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Return a pruned and defaulted copy; ``apiVersion``, ``kind`` and ``metadata`` stay untouched."""
    body = {k: v for k, v in obj.items() if k not in _ROOT_KEYS}
    result = _walk(body, _body_schema(schema))
    return {**{k: obj[k] for k in _ROOT_KEYS if k in obj}, **result}


def _body_schema(schema: dict[str, Any]) -> dict[str, Any]:
    properties = {k: v for k, v in (schema.get("properties") or {}).items() if k not in _ROOT_KEYS}
    required = [r for r in schema.get("required") or [] if r not in _ROOT_KEYS]
    return {**schema, "properties": properties, "required": required}


def _walk(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
            "x-kubernetes-embedded-resource"
        )
        result: dict[str, Any] = {}
        for key, child in value.items():
            child_schema = properties.get(key) if properties is not None else None
            if child_schema is None and isinstance(additional, dict):
                child_schema = additional
            if child_schema is not None:
                if child is not None or child_schema.get("nullable"):
                    result[key] = _walk(child, child_schema)
            elif keep_unknown or (properties is None and additional in (None, True)):
                result[key] = child
        for key, child_schema in (properties or {}).items():
            if key not in result and "default" in child_schema:
                result[key] = _walk(clone(child_schema["default"]), child_schema)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_walk(item, schema["items"]) for item in value]
    return value


def validation_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Field errors as the API server words them: ``spec.replicas: Invalid value: ...``."""
    errors: list[str] = []
    _check({k: v for k, v in obj.items() if k not in _ROOT_KEYS}, _body_schema(schema), "", errors)
    return errors


_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}


def _check(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    where = path or "<root>"
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            errors.append(f'{where}: Invalid value: "null": {where} in body must be of type {schema["type"]}')
        return
    if schema.get("x-kubernetes-int-or-string"):
        if not (_TYPES["integer"](value) or isinstance(value, str)):
            errors.append(
                f"{where}: Invalid value: {_show(value)}: {where} in body must be of type int-or-string"
            )
        return
    kind = schema.get("type")
    if kind in _TYPES and not _TYPES[kind](value):
        errors.append(f"{where}: Invalid value: {_show(value)}: {where} in body must be of type {kind}: "
                      f"{_type_name(value)}")  # fmt: skip
        return
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_show(v) for v in schema["enum"])
        errors.append(f"{where}: Unsupported value: {_show(value)}: supported values: {supported}")
    for composite in ("allOf", "anyOf", "oneOf"):
        if composite in schema:
            _check_composite(value, schema[composite], composite, path, errors)
    if isinstance(value, str):
        _check_string(value, schema, where, errors)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_number(value, schema, where, errors)
    elif isinstance(value, list):
        _check_array(value, schema, path, errors)
    elif isinstance(value, dict):
        _check_object(value, schema, path, errors)


def _check_composite(value: Any, options: list, composite: str, path: str, errors: list[str]) -> None:
    results = []
    for option in options:
        found: list[str] = []
        _check(value, option, path, found)
        results.append(found)
    passing = sum(not found for found in results)
    if composite == "allOf":
        errors.extend(e for found in results for e in found)
    elif passing == 0 or (composite == "oneOf" and passing > 1):
        errors.append(f"{path or '<root>'}: Invalid value: {_show(value)}: must validate {composite}")


def _check_string(value: str, schema: dict[str, Any], where: str, errors: list[str]) -> None:
    if "pattern" in schema and not _regex(schema["pattern"]).search(value):
        errors.append(
            f"{where}: Invalid value: {_show(value)}: {where} in body should match '{schema['pattern']}'"
        )
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{where}: Too long: may not be more than {schema['maxLength']} bytes")
    if "minLength" in schema and len(value) < schema["minLength"]:
        errors.append(f"{where}: Invalid value: {_show(value)}: {where} in body should be at least "
                      f"{schema['minLength']} chars long")  # fmt: skip


def _check_number(value: float, schema: dict[str, Any], where: str, errors: list[str]) -> None:
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and (value < low or (schema.get("exclusiveMinimum") and value == low)):
        relation = "greater than" if schema.get("exclusiveMinimum") else "greater than or equal to"
        errors.append(f"{where}: Invalid value: {_show(value)}: {where} in body should be {relation} {low}")
    if high is not None and (value > high or (schema.get("exclusiveMaximum") and value == high)):
        relation = "less than" if schema.get("exclusiveMaximum") else "less than or equal to"
        errors.append(f"{where}: Invalid value: {_show(value)}: {where} in body should be {relation} {high}")


def _check_array(value: list, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    where = path or "<root>"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{where}: Too many: {len(value)}: must have at most {schema['maxItems']} items")
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(f"{where}: Invalid value: {len(value)}: {where} in body should have at least "
                      f"{schema['minItems']} items")  # fmt: skip
    if isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{index}]", errors)


def _check_object(value: dict, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    for name in schema.get("required") or []:
        if name not in value:
            errors.append(f"{_join(path, name)}: Required value")
    properties = schema.get("properties") or {}
    additional = schema.get("additionalProperties")
    for key, child in value.items():
        child_schema = properties.get(key) or (additional if isinstance(additional, dict) else None)
        if child_schema is not None:
            _check(child, child_schema, _join(path, key), errors)
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        errors.append(f"{path or '<root>'}: Too many: {len(value)}: must have at most "
                      f"{schema['maxProperties']} items")  # fmt: skip
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        errors.append(f"{path or '<root>'}: Invalid value: {len(value)}: should have at least "
                      f"{schema['minProperties']} properties")  # fmt: skip


@functools.lru_cache(maxsize=512)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    return (
        f'"{value}"'
        if isinstance(value, str)
        else repr(value).replace("True", "true").replace("False", "false")
    )


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )
