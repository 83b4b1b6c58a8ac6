"""The LoRABase and LoRAAdapter spec API: one pydantic model per section, the one description of each field.

Each field's description, bounds, pattern, enum and default live on the field; CEL rules live on the
model or field that carries them (``Rule``: the CEL the API server evaluates and the same check in
Python). ``src/loraplane/operator/openapi.py`` turns these models into the CRDs' structural schemas, and the
operator parses specs with them, so the API server and the operator refuse the same specs, and every
error names the field as kubectl shows it (``spec.engine.maxRank``).

Python names are snake_case; the API's camelCase comes from aliases. Parsing is strict (no "3" for 3),
as the API server's schema is; unknown fields are ignored and nulls are absent, as the API server
prunes both. Status sections and the whole objects: crd_objects.py; the base model, Rule and SpecError:
crd_base.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from loraplane.operator.crd_base import ApiModel, Rule, SpecError, cel, spec_error  # noqa: F401  (re-exported)
from loraplane.operator.crd_canary import CANARY_STEPS_RULE, CanaryAnalysis, StepList

GROUP = "loraplane.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
BASE_PLURAL, ADAPTER_PLURAL = "lorabases", "loraadapters"

# A DNS-1123 label: fits a URL path segment, a Prometheus label value, a Secret and a LoRABase name.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX = 63
SHA256_PATTERN = r"^[a-f0-9]{64}$"
DIGEST_PATTERN = r"^sha256:[a-f0-9]{64}$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
QUANTITY_PATTERN = r"^[0-9]+(Ki|Mi|Gi|Ti|K|M|G|T)?$"

DEFAULT_IMAGE = "ghcr.io/loraplane/loraplane-server:0.1.0"
DEFAULT_REPLICAS = 1
MAX_REPLICAS = 256
MAX_TENSOR_PARALLEL = 8  # GPUs of one node; multi-node serving is out of scope
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_MAX_RANK = 64
MAX_RANK_LIMIT = 512
DEFAULT_KV_FRACTION = 0.85
DEFAULT_MAX_NUM_SEQS = 256
MEMORY_MODES = ("split", "unified")
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_DTYPE = "bfloat16"
DEFAULT_GPU_ADAPTER_BYTES = "4Gi"
DEFAULT_HOST_ADAPTER_BYTES = "16Gi"
HOST_CACHE_TYPES = ("emptyDir", "hostPath")
DEFAULT_HOST_CACHE_SIZE = "50Gi"
WARM_TIERS = ("gpu", "host")
DEFAULT_WARM = "host"
DEFAULT_MAX_UNAVAILABLE = 1
DEFAULT_ACCESS_KEY_ID_KEY = "AWS_ACCESS_KEY_ID"
DEFAULT_SECRET_ACCESS_KEY_KEY = "AWS_SECRET_ACCESS_KEY"
DEFAULT_ADMIN_TOKEN_KEY = "token"

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_UNITS.update({"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40})


def quantity_bytes(value: str | int, field_: str = "quantity") -> int:
    """``"4Gi"`` -> 4294967296 (the subset of Kubernetes quantities the schema allows)."""
    text = str(value)
    digits = text.rstrip("KMGTi")
    unit = text[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise SpecError(field_, f"{value!r} is not a byte quantity such as 4Gi or 512Mi")
    return int(digits) * _UNITS[unit]


Name = Annotated[str, Field(pattern=NAME_PATTERN, max_length=NAME_MAX)]
# A DNS-1123 subdomain: the name of a PriorityClass, RuntimeClass or ServiceAccount.
Subdomain = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)]
# Parsed to bytes; the API and the schema keep the string.
Bytes = Annotated[str, Field(pattern=QUANTITY_PATTERN), AfterValidator(quantity_bytes)]
S3_URI = Rule("self.startsWith('s3://') && size(self) > 5", "must be an s3://bucket/prefix/ URI",
              lambda uri: uri.startswith("s3://") and len(uri) > 5)  # fmt: skip


# --- LoRABase ------------------------------------------------------------------------------------------
class ModelRef(ApiModel):
    """The base model every pod of this LoRABase serves."""

    uri: str = Field(
        min_length=1,
        max_length=1024,
        description="Where the base weights are (s3://..., a path baked into the image, or a hub id).",
    )
    sha256: str = Field(
        pattern=SHA256_PATTERN,
        description="Pinned base hash: sha256 of the weight files' content, as `loraplane model hash` "
        "prints it. Pods refuse to start on other weights; adapters trained for another base are refused.",
    )


class Resources(ApiModel):
    """Compute per pod."""

    gpus: int | None = Field(
        None,
        ge=0,
        le=16,
        description="GPUs per pod. Absent: tensorParallelSize (one GPU per rank). 0 runs the engine on CPU; "
        "any other value must equal tensorParallelSize.",
    )
    gpu_resource: str = Field(DEFAULT_GPU_RESOURCE, description="Extended resource name of a GPU.")
    cpu: str | None = Field(None, description="CPU request and limit, a Kubernetes quantity (for example 8).")
    memory: str | None = Field(
        None, description="Memory request and limit, a Kubernetes quantity (for example 64Gi)."
    )


class EngineSpec(ApiModel):
    """Engine settings passed to `loraplane serve`."""

    gpu_adapter_bytes: Bytes = Field(
        DEFAULT_GPU_ADAPTER_BYTES, description="GPU memory reserved for resident adapters."
    )
    host_adapter_bytes: Bytes = Field(
        DEFAULT_HOST_ADAPTER_BYTES, description="Pinned host RAM for warm adapters."
    )
    max_rank: int = Field(
        DEFAULT_MAX_RANK,
        ge=1,
        le=MAX_RANK_LIMIT,
        description="Largest LoRA rank served; higher-rank adapters are refused (RankTooHigh).",
    )
    kv_cache_fraction: float = Field(
        DEFAULT_KV_FRACTION,
        ge=0.05,
        le=0.98,
        description="Fraction of free GPU memory given to the KV cache.",
    )
    max_num_seqs: int = Field(DEFAULT_MAX_NUM_SEQS, ge=1, le=4096, description="Most sequences in one step.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(DEFAULT_DTYPE, description="Compute dtype.")  # fmt: skip
    memory_mode: Literal["split", "unified"] | None = Field(
        None,
        description="GPU memory layout: split (a fixed adapter pool beside the KV cache) or unified (KV blocks "
        "and adapter rows share one pool). Absent: the server's default, split. unified needs "
        "tensorParallelSize 1.",
    )


class HostCache(ApiModel):
    """The pods' content-addressed adapter cache on the node."""

    RULES = (
        Rule("self.type != 'hostPath' || has(self.path)", "path is required when type is hostPath",
             lambda cache: cache.type != "hostPath" or cache.path is not None, ".path"),
    )  # fmt: skip
    type: Literal["emptyDir", "hostPath"] = Field(
        "emptyDir", description="emptyDir (per pod) or hostPath (shared by the pods of a node)."
    )
    path: str | None = Field(
        None, pattern=r"^/[^\x00]*$", max_length=1024, description="Node directory when type is hostPath."
    )
    size_limit: str = Field(DEFAULT_HOST_CACHE_SIZE, pattern=QUANTITY_PATTERN,
                            description="Largest cache size; least-recently-used versions go first.")  # fmt: skip


class SecretRef(ApiModel):
    """A Secret in this namespace, read by name only."""

    name: Name = Field(description="Name of a Secret in this namespace. The operator reads it by name only.")


class S3CredentialsRef(SecretRef):
    """Secret with S3 credentials, mounted into pods by reference."""

    access_key_id_key: str = Field(
        DEFAULT_ACCESS_KEY_ID_KEY, max_length=253, description="Key holding the access key id."
    )
    secret_access_key_key: str = Field(
        DEFAULT_SECRET_ACCESS_KEY_KEY, max_length=253, description="Key holding the secret access key."
    )


class AdminTokenRef(SecretRef):
    """Secret with the pods' admin API token. When absent the operator creates <name>-admin-token, owned by
    this LoRABase."""

    key: str = Field(DEFAULT_ADMIN_TOKEN_KEY, max_length=253, description="Key holding the token.")


class Storage(ApiModel):
    """S3 access for the operator (manifest validation) and the pods (pulls)."""

    endpoint: str | None = Field(None, pattern=r"^https?://.+", max_length=1024,
                                 description="S3 endpoint URL; empty for AWS.")  # fmt: skip
    region: str | None = Field(None, max_length=64, description="S3 region.")
    credentials_secret_ref: S3CredentialsRef | None = None

    @property
    def credentials(self) -> str | None:
        """Name of the Secret holding the S3 credentials, or None."""
        return self.credentials_secret_ref.name if self.credentials_secret_ref else None

    @property
    def access_key_id_key(self) -> str:
        ref = self.credentials_secret_ref
        return ref.access_key_id_key if ref else DEFAULT_ACCESS_KEY_ID_KEY

    @property
    def secret_access_key_key(self) -> str:
        ref = self.credentials_secret_ref
        return ref.secret_access_key_key if ref else DEFAULT_SECRET_ACCESS_KEY_KEY


class PublicKeysRef(SecretRef):
    """Secret whose every key is a trusted Ed25519 public key (PEM); its key is the key id."""


class ApiKeysRef(SecretRef):
    """Secret holding api-keys.yaml (API key -> allowed adapters), mounted."""


class Trust(ApiModel):
    """Who may sign adapters for this base."""

    public_keys_secret_ref: PublicKeysRef | None = None


class Auth(ApiModel):
    """Client authentication of the OpenAI API."""

    api_keys_secret_ref: ApiKeysRef | None = None


FreeForm = dict[str, Any]  # a core/v1 type passed to the pod spec unchanged


class LoRABaseSpec(ApiModel):
    """Desired state of a pool of GPU server pods sharing one base model."""

    RULES = (
        Rule("!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus == 0"
             " || self.resources.gpus == self.tensorParallelSize",
             "must equal tensorParallelSize (one GPU per tensor-parallel rank), be 0 (CPU) or be absent",
             lambda spec: spec.resources.gpus in (None, 0, spec.tensor_parallel_size), ".resources.gpus"),
        Rule("!has(self.engine) || !has(self.engine.memoryMode) || self.engine.memoryMode != 'unified'"
             " || self.tensorParallelSize == 1",
             "unified memory needs tensorParallelSize 1 (one GPU per pod)",
             lambda spec: spec.engine.memory_mode != "unified" or spec.tensor_parallel_size == 1,
             ".engine.memoryMode"),
    )  # fmt: skip
    model: ModelRef
    replicas: int = Field(DEFAULT_REPLICAS, ge=0, le=MAX_REPLICAS, description="Number of server pods.")
    image: str = Field(DEFAULT_IMAGE, min_length=1, description="Server container image.")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=MAX_TENSOR_PARALLEL,
        description="Tensor-parallel ranks per pod: each pod runs `loraplane serve --tensor-parallel-size N` "
        "and requests N GPUs, all on one node (one pod never spans nodes; multi-node serving is not supported). "
        "Pods with N > 1 get a memory-backed /dev/shm for NCCL.",
    )
    resources: Resources = Field(default_factory=Resources)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    host_cache: HostCache = Field(default_factory=HostCache)
    storage: Storage = Field(default_factory=Storage)
    trust: Trust = Field(default_factory=Trust)
    auth: Auth = Field(default_factory=Auth)
    admin_token_secret_ref: AdminTokenRef | None = None
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[Annotated[FreeForm, Field(description="A toleration.")]] = Field(
        default_factory=list, description="Pod tolerations (core/v1 Toleration)."
    )
    affinity: FreeForm = Field(default_factory=dict, description="Pod affinity (core/v1 Affinity).")
    priority_class_name: Subdomain | None = Field(None, description="Pod priorityClassName.")
    service_account_name: Subdomain | None = Field(
        None, description="Pod serviceAccountName (its token is not mounted: the server never calls the API)."
    )
    runtime_class_name: Subdomain | None = Field(None, description="Pod runtimeClassName.")

    # The flat names the builders and reconcilers read.
    model_uri = property(lambda self: self.model.uri)
    model_sha256 = property(lambda self: self.model.sha256)
    gpus = property(
        lambda self: self.tensor_parallel_size if self.resources.gpus is None else self.resources.gpus
    )
    gpu_resource = property(lambda self: self.resources.gpu_resource)
    cpu = property(lambda self: self.resources.cpu)
    memory = property(lambda self: self.resources.memory)
    host_cache_type = property(lambda self: self.host_cache.type)
    host_cache_path = property(lambda self: self.host_cache.path)
    host_cache_size = property(lambda self: self.host_cache.size_limit)
    admin_token = property(lambda self: self.admin_token_secret_ref)  # None: the operator creates one

    @property
    def trusted_keys_secret(self) -> str | None:
        ref = self.trust.public_keys_secret_ref
        return ref.name if ref else None

    @property
    def api_keys_secret(self) -> str | None:
        ref = self.auth.api_keys_secret_ref
        return ref.name if ref else None


# --- LoRAAdapter ---------------------------------------------------------------------------------------
class BaseRef(ApiModel):
    """The LoRABase (same namespace) whose pods serve this adapter."""

    name: Name = Field(description="Name of the LoRABase.")


class Source(ApiModel):
    """Where the signed adapter version is."""

    uri: Annotated[str, AfterValidator(S3_URI.check)] = Field(
        max_length=1024,
        description="s3://bucket/prefix/ holding loraplane-manifest.json, its signature and the files.",
        json_schema_extra=cel(S3_URI),
    )
    manifest_digest: str | None = Field(
        None,
        pattern=DIGEST_PATTERN,
        description="Optional pin: sha256:<hex> of the manifest; anything else is refused (DigestMismatch).",
    )


class Residency(ApiModel):
    """Where the adapter stays between requests."""

    pin: bool = Field(False, description="Never evict from the warm tier.")
    warm: Literal["gpu", "host"] = Field(
        DEFAULT_WARM, description="Tier warmed before the pod reports ready."
    )


class Rollout(ApiModel):
    """How a new version rolls: Switch (load beside, warm, switch every pod, unload the old) or Canary (load
    beside, send a growing share of requests to it step by step while its numbers hold, then switch)."""

    RULES = (CANARY_STEPS_RULE,)
    strategy: Literal["Switch", "Canary"] = Field("Switch", description="Switch or Canary.")
    max_unavailable: int = Field(DEFAULT_MAX_UNAVAILABLE, ge=1, le=MAX_REPLICAS,
                                 description="Pods loading the new version at once.")  # fmt: skip
    steps: StepList = Field(default_factory=list, description="Canary: the steps, in order (with growing "
                            "weights, a conversation on the new version stays there). Once the last passes, the "
                            "version serves every request.")  # fmt: skip
    analysis: CanaryAnalysis = Field(default_factory=CanaryAnalysis)


class Placement(ApiModel):
    """On how many of the base's ready pods the adapter is loaded (default: all of them)."""

    RULES = (
        Rule("!(has(self.replicas) && has(self.share))", "set replicas or share, not both",
             lambda p: p.replicas is None or p.share is None),
    )  # fmt: skip
    replicas: int | None = Field(None, ge=1, le=MAX_REPLICAS,
                                 description="Pods that load it (at most the ready pods of the base).")  # fmt: skip
    share: int | None = Field(None, ge=1, le=100, description="Percent of the base's ready pods that load "
                              "it, rounded up (at least one pod).")  # fmt: skip

    def pods(self, ready: int) -> int:
        """How many of ``ready`` pods load the adapter."""
        if self.replicas is not None:
            return min(self.replicas, ready)
        if self.share is not None:
            return min(ready, max(1, -(-ready * self.share // 100)))
        return ready


class LoRAAdapterSpec(ApiModel):
    """Desired state of one LoRA adapter on every pod of a LoRABase."""

    base_ref: BaseRef
    source: Source
    version: str = Field(pattern=VERSION_PATTERN,
                         description="Human version label; the manifest digest is the identity.")  # fmt: skip
    residency: Residency = Field(default_factory=Residency)
    rollout: Rollout = Field(default_factory=Rollout)
    placement: Placement = Field(default_factory=Placement)

    base = property(lambda self: self.base_ref.name)
    uri = property(lambda self: self.source.uri)
    manifest_digest = property(lambda self: self.source.manifest_digest)
    pin = property(lambda self: self.residency.pin)
    warm = property(lambda self: self.residency.warm)
    max_unavailable = property(lambda self: self.rollout.max_unavailable)
    canary = property(lambda self: self.rollout.strategy == "Canary")


# The names the rest of the operator imports.
BaseSpec, AdapterSpec, SecretKeyRef = LoRABaseSpec, LoRAAdapterSpec, AdminTokenRef
