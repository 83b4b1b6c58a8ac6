"""Condition types and reasons, and the one way conditions are updated.

Conditions follow the Kubernetes API conventions: a list keyed by ``type``, each with ``status``
(True/False/Unknown), ``observedGeneration``, ``lastTransitionTime`` (changes only when ``status``
changes), a CamelCase ``reason`` from the constants below, and a human ``message``. Every condition
starts as Unknown on the first visit. ``Ready`` is the summary; ``Degraded`` says why it is not.
"""

from __future__ import annotations

import datetime

from loraplane.artifacts import errors as A

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"

# --- condition types -------------------------------------------------------------------------------
READY = "Ready"
PROGRESSING = "Progressing"  # LoRABase: the Deployment is rolling or scaling
DEGRADED = "Degraded"
VALIDATED = "Validated"  # LoRAAdapter: manifest fetched, signature, base hash, rank and targets checked
CACHED = "Cached"  # LoRAAdapter: every desired pod holds the version in its host cache
WARMED = "Warmed"  # LoRAAdapter: every desired pod has loaded and warmed the version
CANARY = (
    "Canary"  # LoRAAdapter, canary rollouts: Unknown while steps run, True once promoted, False rolled back
)

BASE_CONDITIONS = (READY, PROGRESSING, DEGRADED)
ADAPTER_CONDITIONS = (VALIDATED, CACHED, WARMED, READY, DEGRADED)

# --- reasons: first visit ----------------------------------------------------------------------------
RECONCILING = "Reconciling"  # the operator has seen the object and not yet decided

# --- reasons: the artifact (the artifacts module's own strings, never retyped; see docs/operator.md) -----
BAD_SIGNATURE = A.BAD_SIGNATURE  # the manifest signature does not verify
UNSIGNED = A.UNSIGNED  # no signature next to the manifest
UNKNOWN_KEY = A.UNKNOWN_KEY  # signed by a key the base does not trust
BASE_MISMATCH = A.BASE_MISMATCH  # trained for another base (manifest base hash != spec.model.sha256)
RANK_TOO_HIGH = A.RANK_TOO_HIGH  # a LoRA rank above LoRABase.spec.engine.maxRank
UNKNOWN_MODULE = A.UNKNOWN_MODULE  # a target module the engine does not serve
DIGEST_MISMATCH = A.DIGEST_MISMATCH  # the manifest digest differs from spec.source.manifestDigest
IDENTITY_MISMATCH = A.IDENTITY_MISMATCH  # the signed name/version differ from metadata.name/spec.version
ROLLBACK_REFUSED = A.ROLLBACK_REFUSED  # older than the serving version, and no pinned manifestDigest
SOURCE_UNREACHABLE = A.SOURCE_UNREACHABLE  # S3 kept failing; retried with backoff
NOT_FOUND = A.NOT_FOUND  # no manifest at spec.source.uri
ACCESS_DENIED = A.ACCESS_DENIED  # S3 refused the operator's credentials
BAD_MANIFEST = A.BAD_MANIFEST  # malformed manifest
VALID = "Valid"  # Validated=True

# --- reasons: the base and its pods ------------------------------------------------------------------
BASE_NOT_FOUND = "BaseNotFound"  # spec.baseRef names no LoRABase in this namespace
BASE_NOT_READY = "BaseNotReady"  # the LoRABase has no ready pod yet
SECRET_NOT_FOUND = "SecretNotFound"  # a referenced Secret (or key) is missing
POD_UNREACHABLE = "PodUnreachable"  # a pod's admin API did not answer
PULL_FAILED = "PullFailed"  # a pod could not pull or verify the artifact
WARM_FAILED = "WarmFailed"  # a pod could not load or warm the version
POD_FAILED = "PodFailed"  # a pod refused for another reason (the message says which)
TOKEN_REFUSED = "Unauthorized"  # a pod refused the admin token (the Secret changed: read it again)
UNLOAD_FAILED = "UnloadFailed"  # deletion: a pod could not unload; the finalizer holds
ROLLED_BACK = "RolledBack"  # a new version failed somewhere; the old version serves everywhere

# --- reasons: canary rollouts (the analysis' own reasons are operator/canary.py's) --------------------------
CANARY_LOADING = "CanaryLoading"  # the new version is loading beside the serving one
CANARY_PAUSED = "CanaryPaused"  # a step's pause is running
CANARY_PROMOTED = "CanaryPromoted"  # every step passed; the new version serves every request
CANARY_ROLLED_BACK = "CanaryRolledBack"  # a step failed; the canary was unloaded everywhere

# --- reasons: progress and success ----------------------------------------------------------------------
ALL_PODS_SERVING = "AllPodsServing"  # Ready=True: every desired pod serves the version
PODS_PENDING = "PodsPending"  # some pods are still pulling, warming or switching
ROLLING_OUT = "RollingOut"  # a new version is loading beside the old one
ALL_CACHED = "AllCached"
ALL_WARMED = "AllWarmed"
AS_EXPECTED = "AsExpected"  # Degraded=False
DEPLOYMENT_AVAILABLE = "DeploymentAvailable"  # LoRABase Ready=True
DEPLOYMENT_PROGRESSING = "DeploymentProgressing"
DEPLOYMENT_STABLE = "DeploymentStable"
PODS_NOT_READY = "PodsNotReady"
POD_BASE_MISMATCH = "PodBaseMismatch"  # a pod reports a base hash other than spec.model.sha256

ARTIFACT_REASONS = frozenset(
    {
        BAD_SIGNATURE,
        UNSIGNED,
        UNKNOWN_KEY,
        BASE_MISMATCH,
        RANK_TOO_HIGH,
        UNKNOWN_MODULE,
        DIGEST_MISMATCH,
        IDENTITY_MISMATCH,
        ROLLBACK_REFUSED,
        SOURCE_UNREACHABLE,
        NOT_FOUND,
        ACCESS_DENIED,
        BAD_MANIFEST,
    }
)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def initial(types: tuple[str, ...], generation: int) -> list[dict]:
    """Every condition Unknown: what the operator writes on its first visit."""
    return [
        condition(t, UNKNOWN, RECONCILING, "the operator is reconciling", generation, now()) for t in types
    ]


def condition(type_: str, status: str, reason: str, message: str, generation: int, since: str) -> dict:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:1024],
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }


def merge(old: list[dict] | None, new: list[dict]) -> list[dict]:
    """``new`` with each lastTransitionTime kept from ``old`` where the status did not change."""
    previous = {c.get("type"): c for c in old or []}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        if before is not None and before.get("status") == cond["status"]:
            cond = {
                **cond,
                "lastTransitionTime": before.get("lastTransitionTime", cond["lastTransitionTime"]),
            }
        merged.append(cond)
    return merged


def get(conditions: list[dict] | None, type_: str) -> dict | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def transitions(old: list[dict] | None, new: list[dict]) -> list[dict]:
    """The conditions whose status or reason changed: each becomes one Kubernetes Event."""
    previous = {c.get("type"): c for c in old or []}
    changed = []
    for cond in new:
        before = previous.get(cond["type"])
        if before is None or (before.get("status"), before.get("reason")) != (cond["status"], cond["reason"]):
            changed.append(cond)
    return changed
