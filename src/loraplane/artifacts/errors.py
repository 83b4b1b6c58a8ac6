"""Why an adapter artifact was refused: one exception type, one stable reason per failure.

Every failure carries a CamelCase ``reason`` (a constant below, safe to put in a Kubernetes condition
reason or a metric label), the ``field`` it concerns (a manifest field such as
``manifest.base_model_hash``, a file name such as ``adapter_model.safetensors``, or ``source.uri``),
and a human message. Messages never contain credentials.
"""

from __future__ import annotations

# --- signature -----------------------------------------------------------------------------------
UNSIGNED = "Unsigned"  # no loraplane-manifest.sig next to the manifest
UNKNOWN_KEY = "UnknownKey"  # signed by a key id that is not among the trusted keys
BAD_SIGNATURE = "BadSignature"  # the signature does not verify, or the .sig file is malformed
BAD_KEY = "BadKey"  # a trusted or private key could not be parsed
# --- identity --------------------------------------------------------------------------------------
DIGEST_MISMATCH = "DigestMismatch"  # the manifest digest differs from the pinned one
BASE_MISMATCH = "BaseMismatch"  # trained for another base model (base hash differs)
IDENTITY_MISMATCH = "IdentityMismatch"  # the signed name or version differs from the one asked for
ROLLBACK_REFUSED = "RollbackRefused"  # signed before the version it would replace, and not pinned by digest
# --- files -----------------------------------------------------------------------------------------
FILE_HASH_MISMATCH = "FileHashMismatch"  # a file's sha256 differs from the manifest
FILE_SIZE_MISMATCH = "FileSizeMismatch"  # a file's size differs from the manifest
MISSING_FILE = "MissingFile"  # a file listed in the manifest (or a required file) is absent
UNEXPECTED_FILE = "UnexpectedFile"  # a file is present that the manifest does not list
BAD_PATH = "BadPath"  # path traversal, nested or absurd file names
PICKLE_WEIGHTS = "PickleWeights"  # .bin/.pt/.pkl/... weights: pickle is never loaded
FILE_TOO_LARGE = "FileTooLarge"  # above the configured size limit
# --- content ---------------------------------------------------------------------------------------
RANK_TOO_HIGH = "RankTooHigh"  # a LoRA rank above the limit
UNKNOWN_MODULE = "UnknownModule"  # a target module the engine does not serve
UNSUPPORTED_ADAPTER = (
    "UnsupportedAdapter"  # a PEFT option that changes the math in a way not served (DoRA, ...)
)
SHAPE_MISMATCH = "ShapeMismatch"  # lora_A/lora_B shapes do not fit the base model
RANK_MISMATCH = "RankMismatch"  # adapter_config.json's r or rank_pattern differs from the weights' ranks
BAD_MANIFEST = "BadManifest"  # malformed manifest or adapter_config.json
BAD_TENSOR_LAYOUT = (
    "BadTensorLayout"  # safetensors header, dtypes, shapes or data_offsets do not fit the file
)
NON_FINITE_WEIGHTS = "NonFiniteWeights"  # a NaN or Inf in the weights
# --- source ----------------------------------------------------------------------------------------
BAD_URI = "BadUri"  # not a well-formed s3://bucket/prefix/ URI
SOURCE_UNREACHABLE = "SourceUnreachable"  # S3 kept failing (5xx, throttling, timeouts, truncation)
ACCESS_DENIED = "AccessDenied"  # S3 refused the credentials (403, SignatureDoesNotMatch, ...)
NOT_FOUND = "NotFound"  # no such bucket, prefix or object
# --- local -----------------------------------------------------------------------------------------
CACHE_FULL = "CacheFull"  # the host cache cannot make room (everything else pinned or in use)
VERSION_EXISTS = "VersionExists"  # push: another manifest already lives under this name/version

REASONS = frozenset(
    {
        UNSIGNED,
        UNKNOWN_KEY,
        BAD_SIGNATURE,
        BAD_KEY,
        DIGEST_MISMATCH,
        BASE_MISMATCH,
        IDENTITY_MISMATCH,
        ROLLBACK_REFUSED,
        RANK_MISMATCH,
        BAD_TENSOR_LAYOUT,
        NON_FINITE_WEIGHTS,
        FILE_HASH_MISMATCH,
        FILE_SIZE_MISMATCH,
        MISSING_FILE,
        UNEXPECTED_FILE,
        BAD_PATH,
        PICKLE_WEIGHTS,
        FILE_TOO_LARGE,
        RANK_TOO_HIGH,
        UNKNOWN_MODULE,
        UNSUPPORTED_ADAPTER,
        SHAPE_MISMATCH,
        BAD_MANIFEST,
        BAD_URI,
        SOURCE_UNREACHABLE,
        ACCESS_DENIED,
        NOT_FOUND,
        CACHE_FULL,
        VERSION_EXISTS,
    }
)

# Reasons that say "the artifact is fine, the way to it is not": worth retrying later.
TRANSIENT_REASONS = frozenset({SOURCE_UNREACHABLE})


class ArtifactError(Exception):
    """An artifact was refused. ``reason`` is one of the constants above."""

    def __init__(self, reason: str, message: str, field: str | None = None):
        if reason not in REASONS:
            raise ValueError(f"unknown ArtifactError reason {reason!r}")
        super().__init__(f"{reason}: {field + ': ' if field else ''}{message}")
        self.reason = reason
        self.field = field
        self.message = message

    @property
    def transient(self) -> bool:
        return self.reason in TRANSIENT_REASONS

    def to_dict(self) -> dict:
        return {"reason": self.reason, "field": self.field, "message": self.message}
