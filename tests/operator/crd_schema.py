"""What the API server does with a CRD's openAPIV3Schema, offline: the structural-schema rules it checks
when the CRD is created, and for a custom resource: null pruning, defaulting, schema validation and CEL.

Patterns use CEL's ``matches`` (RE2 semantics, as the API server's Go regexp: ``$`` is the end of the
text, not "before a final newline" as in Python's ``re``), so the schema side is not more lenient than
the server. Paths are kubectl's: ``spec.engine.maxRank``, ``spec.tolerations[0]``.
"""

from __future__ import annotations

import copy
import functools
import pathlib

import cel
import jsonschema
import yaml
from hypothesis import strategies as st

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALLOWED = {  # the keywords of a structural schema this project uses; anything else is a finding
    "type", "description", "format", "enum", "pattern", "minLength", "maxLength", "minimum", "maximum",
    "maxItems", "default", "items", "properties", "additionalProperties", "required", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-validations",
}  # fmt: skip
FORMATS = {"date-time"}


@functools.cache
def crd_schema(kind: str) -> dict:
    """The committed CRD's openAPIV3Schema (shared: do not mutate)."""
    name = {"LoRABase": "lorabase.yaml", "LoRAAdapter": "loraadapter.yaml"}[kind]
    crd = yaml.safe_load((ROOT / "crds" / name).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _child(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


# --- the CRD: structural-schema rules (apiextensions' validation of a CRD) -----------------------------
def structural_problems(schema: dict, path: str = "", root: bool = True) -> list[str]:
    problems = [f"{path}: keyword {k}" for k in schema if k not in ALLOWED]
    if not schema.get("type") and not schema.get("x-kubernetes-preserve-unknown-fields"):
        problems.append(f"{path}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{path}: properties and additionalProperties together")
    if schema.get("additionalProperties") in (True, False):
        problems.append(f"{path}: additionalProperties must be a schema")
    if schema.get("type") == "array" and not isinstance(schema.get("items"), dict):
        problems.append(f"{path}: an array needs one items schema")
    if schema.get("format") and schema["format"] not in FORMATS:
        problems.append(f"{path}: format {schema['format']}")
    if schema.get("type") == "object" and set(schema.get("required", [])) - set(schema.get("properties", {})):
        problems.append(f"{path}: required names an undeclared property")
    if "default" in schema:
        try:
            jsonschema.validate(schema["default"], schema)
        except jsonschema.ValidationError as exc:
            problems.append(f"{path}: default is invalid: {exc.message}")
    if schema.get("x-kubernetes-list-type") == "map":
        items = schema.get("items", {})
        for key in schema.get("x-kubernetes-list-map-keys", []):
            sub = items.get("properties", {}).get(key, {})
            if key not in items.get("required", []) and "default" not in sub:
                problems.append(f"{path}: list-map key {key} must be required or defaulted")
            if sub.get("type") not in ("string", "integer", "boolean"):
                problems.append(f"{path}: list-map key {key} must be a scalar")
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            cel.compile(rule["rule"])
        except Exception as exc:  # the binding raises its own types
            problems.append(f"{path}: CEL rule {rule['rule']!r} does not compile: {exc}")
        field = rule.get("fieldPath", "")
        if field and field.lstrip(".").split(".")[0] not in schema.get("properties", {}):
            problems.append(f"{path}: fieldPath {field} names no property")
    if root:
        if schema.get("type") != "object":
            problems.append("root: must be an object")
        if schema.get("properties", {}).get("metadata") != {"type": "object"}:
            problems.append("root: metadata must be {type: object} (only name may be restricted)")
    for key, sub in schema.get("properties", {}).items():
        problems += structural_problems(sub, _child(path, key), root=False)
    if isinstance(schema.get("items"), dict):
        problems += structural_problems(schema["items"], f"{path}[]", root=False)
    if isinstance(schema.get("additionalProperties"), dict):
        problems += structural_problems(schema["additionalProperties"], f"{path}{{}}", root=False)
    return problems


# --- a custom resource: what the API server does with one ------------------------------------------------
def prune_and_default(schema: dict, value):
    """Nulls of declared fields dropped, then defaults filled in: the object the server validates."""
    if isinstance(value, dict) and "properties" in schema:
        value = {k: v for k, v in value.items() if v is not None}
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = prune_and_default(sub, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [prune_and_default(schema["items"], v) for v in value]
    return value


def _re2_match(pattern: str, text: str) -> bool:
    return bool(cel.evaluate("self.matches(p)", {"self": text, "p": pattern}))


def _pattern(validator, pattern, instance, schema):
    if isinstance(instance, str) and not _re2_match(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _is_integer(checker, instance) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)  # 1.0 is a number, not an integer


Validator = jsonschema.validators.extend(
    jsonschema.Draft7Validator,
    validators={"pattern": _pattern},
    type_checker=jsonschema.Draft7Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


def _schema_errors(validator, obj) -> list[tuple[str, str]]:
    errors = []
    for error in validator.iter_errors(obj):
        path = ""
        for key in error.absolute_path:
            path = _child(path, key)
        if error.validator == "required":  # the server names the missing field itself
            missing = [k for k in error.validator_value if k not in error.instance]
            path = _child(path, missing[0])
        errors.append((path, error.message))
    return errors


def _cel_errors(schema: dict, value, path: str) -> list[tuple[str, str]]:
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            holds = cel.evaluate(rule["rule"], {"self": value}) is True
        except Exception:  # an error in a rule refuses the object, as on the server
            holds = False
        if not holds:
            errors.append((path + rule.get("fieldPath", ""), rule["message"]))
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += _cel_errors(sub, value[key], _child(path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, _child(path, i))
    return errors


@functools.cache
def _validator(kind: str):
    return Validator(crd_schema(kind))


def server_errors(kind: str, obj: dict) -> list[tuple[str, str]]:
    """The (path, message) list the API server would refuse ``obj`` with; empty when it would accept it."""
    schema = crd_schema(kind)
    obj = prune_and_default(schema, obj)
    errors = _schema_errors(_validator(kind), obj)
    return errors or _cel_errors(schema, obj, "")  # CEL runs on a well-typed object


# --- instances from a schema -------------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=5), inner, max_size=2),
    max_leaves=4,
)


def instances(schema: dict) -> st.SearchStrategy:
    """Values shaped by ``schema``: bounds, patterns, enums and required fields followed (CEL rules not)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 10**6)
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: low <= len(s) <= high)
        return st.text(min_size=low, max_size=min(high, 40))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        keys = schema.get("x-kubernetes-list-map-keys")
        unique = (lambda item: tuple(item.get(k) for k in keys)) if keys else None
        return st.lists(instances(schema["items"]), max_size=3, unique_by=unique)
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", []))
        props = {k: instances(v) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return st.dictionaries(st.text(min_size=1, max_size=8), instances(schema["additionalProperties"]),
                               max_size=3)  # fmt: skip
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return st.dictionaries(st.text(max_size=8), JSON, max_size=3)
    raise AssertionError(f"no strategy for {schema}")


def node_at(schema: dict, where: tuple) -> dict | None:
    """The schema node of the value at ``where`` (keys and list indexes), or None where it is free-form."""
    for key in where:
        if isinstance(key, int):
            schema = schema.get("items")
        elif "properties" in schema:
            schema = schema["properties"].get(key)
        else:
            schema = (
                schema.get("additionalProperties")
                if isinstance(schema.get("additionalProperties"), dict)
                else None
            )
        if schema is None:
            return None
    return schema


def near_misses(schema: dict) -> st.SearchStrategy:
    """Values at the edges of ``schema``: each bound, one past it, a pattern's match bent by one character."""
    kind, options = schema.get("type"), []
    if kind in ("integer", "number"):
        step = 1 if kind == "integer" else 1e-9
        for bound, sign in (("minimum", -1), ("maximum", 1)):
            if bound in schema:
                options += [schema[bound], schema[bound] + sign * step]
    if kind == "string":
        for bound, delta in (("minLength", -1), ("maxLength", 1)):
            if bound in schema and schema[bound] + delta >= 0:
                options += ["a" * schema[bound], "a" * (schema[bound] + delta)]
        options += [v.upper() for v in schema.get("enum", [])] + [v + " " for v in schema.get("enum", [])]
    strategies = [st.sampled_from(options)] if options else []
    if kind == "string" and "pattern" in schema:
        bent = st.tuples(
            st.from_regex(schema["pattern"], fullmatch=True), st.sampled_from(["drop", "add", "up"])
        )
        strategies.append(bent.map(lambda pair: _bend(*pair)))
    return st.one_of(strategies) if strategies else st.nothing()


def _bend(text: str, how: str) -> str:
    if how == "drop":
        return text[:-1]
    if how == "add":
        return text + ("0" if text[-1:].isalpha() else "a")
    return text.upper() if text != text.upper() else text + "\n"


def field_paths(schema: dict, where: tuple = ()) -> list[tuple]:
    """Every declared field under ``schema`` (list items as index 0), parents before children."""
    found = [where] if where else []
    for key, sub in schema.get("properties", {}).items():
        found += field_paths(sub, (*where, key))
    if isinstance(schema.get("items"), dict):
        found += field_paths(schema["items"], (*where, 0))
    return found
