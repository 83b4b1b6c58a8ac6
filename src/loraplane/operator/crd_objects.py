"""What the operator writes (status sections, conditions) and the two whole objects the CRDs describe.

Status is written only through these models (``status_patch``), so the status schema and the status
writer cannot disagree. ``LoRABase`` and ``LoRAAdapter`` are the CRDs' root schemas: apiVersion, kind,
metadata (whose name the root CEL rules bound), spec and status.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from loraplane.operator.crd_canary import MAX_STEPS as MAX_CANARY_STEPS
from loraplane.operator.crd_models import (
    MAX_RANK_LIMIT,
    NAME_MAX,
    NAME_PATTERN,
    ApiModel,
    LoRAAdapterSpec,
    LoRABaseSpec,
    Name,
    Rule,
    spec_error,
)

GENERATION_MAX = 2**62
COUNT_MAX = 10**6
DATE_TIME = {"format": "date-time"}


class StatusModel(BaseModel):
    """A status section: built by the operator in Python (snake_case), written in camelCase."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        strict=True,
        extra="forbid",  # a misspelt status key fails here, not silently on the API server
    )

    def patch(self) -> dict:
        """The merge patch that writes this status: set fields, and None for fields set to None (removed)."""
        body = self.model_dump(by_alias=True, exclude_none=True)
        for name in self.model_fields_set:
            if getattr(self, name) is None:
                body[type(self).model_fields[name].alias or name] = None
        return body


class Condition(StatusModel):
    """A condition, per the Kubernetes API conventions."""

    type: str = Field(description="Condition type, for example Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(None, description="A CamelCase reason (documented in docs/operator.md).")
    message: str | None = Field(None, description="Human-readable detail.")
    observed_generation: int | None = Field(
        None, ge=0, le=GENERATION_MAX, description="metadata.generation this condition was computed for."
    )
    last_transition_time: str | None = Field(
        None, description="When status last changed.", json_schema_extra=DATE_TIME
    )


def conditions_field():
    return Field(
        None,
        description="Current state, one entry per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


def generation_field():
    return Field(None, ge=0, le=GENERATION_MAX, description="metadata.generation last reconciled.")


def count_field(description: str):
    return Field(None, ge=0, le=COUNT_MAX, description=description)


class LoRABaseStatus(StatusModel):
    """Observed state, written by the operator only."""

    observed_generation: int | None = generation_field()
    replicas: int | None = count_field("Server pods that exist.")
    ready_replicas: int | None = count_field("Server pods that are ready.")
    selector: str | None = Field(None, description="Label selector of the pods (scale subresource).")
    observed_base_hash: str | None = Field(
        None,
        max_length=64,
        description="Base hash the ready pods report; empty while pods disagree or none answers.",
    )
    endpoint: str | None = Field(None, description="In-cluster URL of the OpenAI API.")
    admin_token_secret: Name | None = Field(
        None, description="Secret holding the admin token (by name; never its value)."
    )
    conditions: list[Condition] | None = conditions_field()


class PodStatus(StatusModel):
    """One pod's truth, from its admin API."""

    name: str = Field(description="Pod name.")
    version: str | None = Field(None, description="Version the pod serves (or is loading).")
    state: Literal["Pending", "Loading", "Warm", "Serving", "Failed", "Unreachable", "Unloading"] = Field(
        description="Pending, Loading, Warm (loaded, not serving), Serving, Failed, Unreachable, Unloading."
    )
    message: str | None = Field(None, description="Detail, for Failed and Unreachable.")
    since: str | None = Field(None, description="When state last changed.", json_schema_extra=DATE_TIME)


# --- status.canary ------------------------------------------------------------------------------------------
class CanaryNumbers(StatusModel):
    """The numbers one analysis decided on: each version's requests, errors and p95 TTFT over the step."""

    canary_requests: int = Field(0, ge=0, description="Requests the new version answered in the step.")
    canary_errors: int = Field(0, ge=0, description="Of them, the ones the server failed.")
    canary_ttft_p95: float | None = Field(
        None, ge=0, alias="canaryTTFTP95", description="p95 time to first token, seconds."
    )
    stable_requests: int = Field(0, ge=0, description="Requests the serving version answered in the step.")
    stable_errors: int = Field(0, ge=0, description="Of them, the ones the server failed.")
    stable_ttft_p95: float | None = Field(
        None, ge=0, alias="stableTTFTP95", description="p95 time to first token, seconds."
    )
    error_rate: float | None = Field(None, ge=0, description="canaryErrors / canaryRequests.")
    ttft_ratio: float | None = Field(
        None, ge=0, alias="ttftRatio", description="canaryTTFTP95 / stableTTFTP95."
    )
    verdict: str = Field(description="Promote (the step passed), Wait (too few samples) or RollBack.")
    time: str = Field(description="When.", json_schema_extra=DATE_TIME)


class CanaryStatus(StatusModel):
    """The canary of spec.version: where it stands (kept after it ends; the Canary condition says how)."""

    version: str = Field(description="The version under canary.")
    digest: str = Field(description="Its manifest digest.")
    step: int = Field(ge=0, le=MAX_CANARY_STEPS, description="The current step, from 1 (0: loading).")
    steps: int = Field(ge=1, le=MAX_CANARY_STEPS, description="Steps in spec.rollout.steps.")
    weight: int = Field(ge=0, le=100, description="Percent of requests it gets now (100 once promoted, 0 once "
                        "rolled back).")  # fmt: skip
    step_start_time: str | None = Field(None, description="When the current step began.",
                                        json_schema_extra=DATE_TIME)  # fmt: skip
    observed_generation: int | None = generation_field()
    analysis: CanaryNumbers | None = Field(None, description="The last analysis.")


class LoRAAdapterStatus(StatusModel):
    """Observed state, written by the operator only."""

    observed_generation: int | None = generation_field()
    serving_version: str | None = Field(None, description="Version most pods serve (every pod once Ready).")
    digest: str | None = Field(None, description="Manifest digest of servingVersion.")
    serving_source: str | None = Field(
        None,
        description="Source URI of servingVersion (restored to restarted pods while a new version fails).",
    )
    validated_digest: str | None = Field(None, description="Manifest digest of spec.version, once validated.")
    rank: int | None = Field(
        None, ge=0, le=MAX_RANK_LIMIT, description="Largest LoRA rank of the validated version."
    )
    ready_pods: int | None = count_field("Pods serving spec.version.")
    desired_pods: int | None = count_field("Pods that should serve it (the base's replicas).")
    pods: list[PodStatus] | None = Field(
        None,
        description="Per-pod state.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    canary: CanaryStatus | None = Field(
        None, description="The canary rollout of spec.version (spec.rollout.strategy Canary)."
    )
    conditions: list[Condition] | None = conditions_field()  # fmt: skip


def _name(obj) -> str | None:
    name = obj.metadata.get("name")
    return name if isinstance(name, str) else None


def name_rules(pattern: str, most: int, why: str) -> tuple[Rule, ...]:
    """metadata.name bounds. CEL at the root is the one place a CRD may restrict the object's name."""
    return (
        Rule(f"size(self.metadata.name) <= {most}", f"metadata.name must be at most {most} characters ({why})",
             lambda obj: _name(obj) is not None and len(_name(obj)) <= most, names=".metadata.name"),
        Rule(f"self.metadata.name.matches('{pattern}')", f"metadata.name must match {pattern} ({why})",
             lambda obj: re.fullmatch(pattern, _name(obj) or "") is not None, names=".metadata.name"),
    )  # fmt: skip


# A LoRABase names its Services <name> and <name>-admin: a DNS-1035 label of at most 63 - len("-admin").
BASE_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
BASE_NAME_MAX = NAME_MAX - len("-admin")


class _Object(ApiModel):
    api_version: str | None = Field(None, description="APIVersion of this object.")
    kind: str | None = Field(None, description="Kind of this object.")
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def parse(cls, data: dict | None, prefix: str = ""):
        """The object's name and spec checked (status is the operator's own); paths from the root."""
        try:
            return cls.model_validate({k: v for k, v in (data or {}).items() if k != "status"})
        except ValidationError as exc:
            raise spec_error(exc, prefix) from None


class LoRABase(_Object):
    """LoRABase: see docs/operator.md."""

    RULES = name_rules(BASE_NAME_PATTERN, BASE_NAME_MAX, "it names the Services <name> and <name>-admin")
    spec: LoRABaseSpec
    status: LoRABaseStatus | None = None


class LoRAAdapter(_Object):
    """LoRAAdapter: see docs/operator.md."""

    RULES = name_rules(NAME_PATTERN, NAME_MAX, "it is the model name in URLs and a metric label")
    spec: LoRAAdapterSpec
    status: LoRAAdapterStatus | None = None


STATUS_MODELS = {"lorabases": LoRABaseStatus, "loraadapters": LoRAAdapterStatus}


def status_patch(plural: str, status: dict) -> dict:
    """``status`` (camelCase, None to remove a key) checked by the kind's status model: the patch to write."""
    return STATUS_MODELS[plural].model_validate(status).patch()
