"""The machinery under the CRD models: a strict camelCase base model, CEL rules with Python twins, and
SpecError, whose paths are kubectl's (``spec.engine.maxRank``), taken from pydantic's error locations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.alias_generators import to_camel


class SpecError(ValueError):
    """A field is missing or invalid; ``field`` is its path as kubectl shows it (``spec.model.sha256``).

    ``problems`` holds every (path, message) the parse found; ``field`` is the first one's path."""

    def __init__(self, field_: str, message: str, problems: tuple[tuple[str, str], ...] = ()):
        self.problems = problems or ((field_, message),)
        super().__init__("; ".join(f"{path}: {text}" for path, text in self.problems))
        self.field = field_


class RuleError(ValueError):
    """A ``Rule`` does not hold; ``field_path`` is where the API server reports it (".path")."""

    def __init__(self, message: str, field_path: str = ""):
        super().__init__(message)
        self.field_path = field_path


@dataclass(frozen=True, slots=True)
class Rule:
    """One x-kubernetes-validations rule: the CEL the API server runs and the same check in Python."""

    cel: str
    message: str
    holds: Callable[[Any], bool]  # the Python twin, given the model (or the field's value)
    field_path: str = ""  # relative to the node carrying the rule, as CEL's fieldPath
    names: str = ""  # where the operator reports it when the server cannot say (metadata.name at the root)

    def schema(self) -> dict:
        return {"rule": self.cel, "message": self.message} | (
            {"fieldPath": self.field_path} if self.field_path else {}
        )

    def check(self, value):
        if not self.holds(value):
            raise RuleError(self.message, self.names or self.field_path)
        return value


def cel(*rules: Rule) -> dict:
    """``json_schema_extra`` of a field carrying ``rules``."""
    return {"x-kubernetes-validations": [r.schema() for r in rules]}


def _model_rules(schema: dict, cls) -> None:
    if getattr(cls, "RULES", ()):
        schema["x-kubernetes-validations"] = [r.schema() for r in cls.RULES]


class ApiModel(BaseModel):
    """A section of the API; subclasses list their object-level CEL rules in ``RULES``."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=False,  # a spec says maxRank; max_rank would be pruned by the API server
        strict=True,
        frozen=True,
        extra="ignore",
        validate_default=True,  # defaults go through the same validators (4Gi -> bytes)
        json_schema_extra=_model_rules,
    )
    RULES: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _prune_nulls(cls, data):
        """A null field is an absent one, as the API server prunes nulls the schema does not allow."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check_rules(self):
        for rule in self.RULES:
            rule.check(self)
        return self

    @classmethod
    def parse(cls, data: dict | None, prefix: str = "spec"):
        """``model_validate``, with every error turned into one SpecError naming kubectl's field paths."""
        try:
            return cls.model_validate(data if data is not None else {})
        except ValidationError as exc:
            raise spec_error(exc, prefix) from None


def field_path(prefix: str, loc: tuple) -> str:
    """``("engine", "maxRank")`` -> ``spec.engine.maxRank``; list indexes as ``[0]``."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def spec_error(exc: ValidationError, prefix: str = "spec") -> SpecError:
    problems = []
    for err in exc.errors(include_url=False):
        path, message = field_path(prefix, err["loc"]), err["msg"]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, RuleError):
            path, message = (path + cause.field_path).lstrip("."), str(cause)
        problems.append((path, message))
    return SpecError(problems[0][0], problems[0][1], tuple(problems))
