"""Typed, validated views of LoRABase and LoRAAdapter specs, and the defaults the CRD schemas publish.

The CRD schemas (crds.py) and these parsers share the constants below, so a default or a bound is
written once. The API server validates with the schema; these parsers validate again (clusters without
the CRD's CEL rules, and the emulator, do not), and every error names the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

GROUP = "loraplane.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
BASE_PLURAL, ADAPTER_PLURAL = "lorabases", "loraadapters"

NAME_PATTERN = r"^[a-z0-9-]{1,63}$"
SHA256_PATTERN = r"^[a-f0-9]{64}$"
DIGEST_PATTERN = r"^sha256:[a-f0-9]{64}$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
QUANTITY_PATTERN = r"^[0-9]+(Ki|Mi|Gi|Ti|K|M|G|T)?$"

DEFAULT_IMAGE = "ghcr.io/loraplane/loraplane-server:0.1.0"
DEFAULT_REPLICAS = 1
MAX_REPLICAS = 256
DEFAULT_GPUS = 1
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_MAX_RANK = 64
MAX_RANK_LIMIT = 512
DEFAULT_KV_FRACTION = 0.85
DEFAULT_MAX_NUM_SEQS = 256
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


class SpecError(ValueError):
    """A spec field is missing or out of bounds; ``field`` is its path (``spec.model.sha256``)."""

    def __init__(self, field_: str, message: str):
        super().__init__(f"{field_}: {message}")
        self.field = field_


def quantity_bytes(value: str | int, field_: str) -> int:
    """``"4Gi"`` -> 4294967296 (the subset of Kubernetes quantities the schema allows)."""
    match = re.match(QUANTITY_PATTERN, str(value))
    if not match:
        raise SpecError(field_, f"{value!r} is not a byte quantity such as 4Gi or 512Mi")
    return int(str(value)[: match.start(1)] if match.group(1) else value) * _UNITS[match.group(1) or ""]


def _get(obj: dict, key: str, path: str, kind: type, default=None, required: bool = False):
    value = (obj or {}).get(key, default)
    if value is None:
        if required:
            raise SpecError(f"{path}.{key}", "is required")
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SpecError(f"{path}.{key}", f"must be {kind.__name__}, got {value!r}")
    return value


def _match(value: str, pattern: str, field_: str) -> str:
    if not re.match(pattern, value):
        raise SpecError(field_, f"{value!r} does not match {pattern}")
    return value


def _bounded(value, low, high, field_: str):
    if not low <= value <= high:
        raise SpecError(field_, f"{value!r} is outside [{low}, {high}]")
    return value


def _secret_name(spec: dict, section: str, ref: str) -> str | None:
    """``spec.<section>.<ref>.name``, checked, or None when the reference is absent."""
    outer = _get(spec, section, "spec", dict, {})
    inner = _get(outer, ref, f"spec.{section}", dict, {})
    name = _get(inner, "name", f"spec.{section}.{ref}", str)
    return _match(name, NAME_PATTERN, f"spec.{section}.{ref}.name") if name else None


@dataclass(frozen=True, slots=True)
class SecretKeyRef:
    """A Secret in the object's namespace, read by name only."""

    name: str
    key: str

    @classmethod
    def parse(cls, obj: dict | None, path: str, default_key: str) -> SecretKeyRef | None:
        if not obj:
            return None
        name = _match(_get(obj, "name", path, str, required=True), NAME_PATTERN, f"{path}.name")
        return cls(name, _get(obj, "key", path, str, default_key))


@dataclass(frozen=True, slots=True)
class Storage:
    endpoint: str | None
    region: str | None
    credentials: str | None  # Secret name holding AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    access_key_id_key: str = DEFAULT_ACCESS_KEY_ID_KEY
    secret_access_key_key: str = DEFAULT_SECRET_ACCESS_KEY_KEY

    @classmethod
    def parse(cls, storage: dict) -> Storage:
        creds = _get(storage, "credentialsSecretRef", "spec.storage", dict, {})
        name = _get(creds, "name", "spec.storage.credentialsSecretRef", str)
        return cls(
            endpoint=_get(storage, "endpoint", "spec.storage", str),
            region=_get(storage, "region", "spec.storage", str),
            credentials=_match(name, NAME_PATTERN, "spec.storage.credentialsSecretRef.name")
            if name
            else None,
            access_key_id_key=_get(
                creds, "accessKeyIdKey", "spec.storage.credentialsSecretRef", str, DEFAULT_ACCESS_KEY_ID_KEY
            ),
            secret_access_key_key=_get(
                creds,
                "secretAccessKeyKey",
                "spec.storage.credentialsSecretRef",
                str,
                DEFAULT_SECRET_ACCESS_KEY_KEY,
            ),
        )


@dataclass(frozen=True, slots=True)
class EngineSpec:
    gpu_adapter_bytes: int
    host_adapter_bytes: int
    max_rank: int
    kv_cache_fraction: float
    max_num_seqs: int
    dtype: str

    @classmethod
    def parse(cls, eng: dict) -> EngineSpec:
        dtype = _get(eng, "dtype", "spec.engine", str, DEFAULT_DTYPE)
        if dtype not in DTYPES:
            raise SpecError("spec.engine.dtype", f"{dtype!r} is not one of {DTYPES}")
        return cls(
            gpu_adapter_bytes=quantity_bytes(
                _get(eng, "gpuAdapterBytes", "spec.engine", str, DEFAULT_GPU_ADAPTER_BYTES),
                "spec.engine.gpuAdapterBytes",
            ),
            host_adapter_bytes=quantity_bytes(
                _get(eng, "hostAdapterBytes", "spec.engine", str, DEFAULT_HOST_ADAPTER_BYTES),
                "spec.engine.hostAdapterBytes",
            ),
            max_rank=_bounded(
                _get(eng, "maxRank", "spec.engine", int, DEFAULT_MAX_RANK),
                1,
                MAX_RANK_LIMIT,
                "spec.engine.maxRank",
            ),
            kv_cache_fraction=_bounded(
                _get(eng, "kvCacheFraction", "spec.engine", float, DEFAULT_KV_FRACTION),
                0.05,
                0.98,
                "spec.engine.kvCacheFraction",
            ),
            max_num_seqs=_bounded(
                _get(eng, "maxNumSeqs", "spec.engine", int, DEFAULT_MAX_NUM_SEQS),
                1,
                4096,
                "spec.engine.maxNumSeqs",
            ),
            dtype=dtype,
        )


@dataclass(frozen=True, slots=True)
class BaseSpec:
    model_uri: str
    model_sha256: str
    replicas: int
    image: str
    gpus: int
    gpu_resource: str
    cpu: str | None
    memory: str | None
    engine: EngineSpec
    host_cache_type: str
    host_cache_path: str | None
    host_cache_size: str
    storage: Storage
    trusted_keys_secret: str | None
    api_keys_secret: str | None
    admin_token: SecretKeyRef | None  # None: the operator creates <base>-admin-token
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)
    affinity: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: dict) -> BaseSpec:
        model = _get(spec, "model", "spec", dict, required=True)
        sha = _match(
            _get(model, "sha256", "spec.model", str, required=True), SHA256_PATTERN, "spec.model.sha256"
        )
        eng = _get(spec, "engine", "spec", dict, {})
        res = _get(spec, "resources", "spec", dict, {})
        cache = _get(spec, "hostCache", "spec", dict, {})
        storage = _get(spec, "storage", "spec", dict, {})
        cache_type = _get(cache, "type", "spec.hostCache", str, "emptyDir")
        if cache_type not in HOST_CACHE_TYPES:
            raise SpecError("spec.hostCache.type", f"{cache_type!r} is not one of {HOST_CACHE_TYPES}")
        if cache_type == "hostPath" and not cache.get("path"):
            raise SpecError("spec.hostCache.path", "is required when type is hostPath")
        return cls(
            model_uri=_get(model, "uri", "spec.model", str, required=True),
            model_sha256=sha,
            replicas=_bounded(
                _get(spec, "replicas", "spec", int, DEFAULT_REPLICAS), 0, MAX_REPLICAS, "spec.replicas"
            ),
            image=_get(spec, "image", "spec", str, DEFAULT_IMAGE),
            gpus=_bounded(
                _get(res, "gpus", "spec.resources", int, DEFAULT_GPUS), 0, 16, "spec.resources.gpus"
            ),
            gpu_resource=_get(res, "gpuResource", "spec.resources", str, DEFAULT_GPU_RESOURCE),
            cpu=_get(res, "cpu", "spec.resources", str),
            memory=_get(res, "memory", "spec.resources", str),
            engine=EngineSpec.parse(eng),
            host_cache_type=cache_type,
            host_cache_path=cache.get("path"),
            host_cache_size=_match(
                _get(cache, "sizeLimit", "spec.hostCache", str, DEFAULT_HOST_CACHE_SIZE),
                QUANTITY_PATTERN,
                "spec.hostCache.sizeLimit",
            ),
            storage=Storage.parse(storage),
            trusted_keys_secret=_secret_name(spec, "trust", "publicKeysSecretRef"),
            api_keys_secret=_secret_name(spec, "auth", "apiKeysSecretRef"),
            admin_token=SecretKeyRef.parse(
                spec.get("adminTokenSecretRef"), "spec.adminTokenSecretRef", DEFAULT_ADMIN_TOKEN_KEY
            ),
            node_selector=_get(spec, "nodeSelector", "spec", dict, {}),
            tolerations=_get(spec, "tolerations", "spec", list, []),
            affinity=_get(spec, "affinity", "spec", dict, {}),
        )


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    base: str
    uri: str
    manifest_digest: str | None
    version: str
    pin: bool
    warm: str
    max_unavailable: int

    @classmethod
    def parse(cls, spec: dict) -> AdapterSpec:
        base = _get(spec, "baseRef", "spec", dict, required=True)
        source = _get(spec, "source", "spec", dict, required=True)
        uri = _get(source, "uri", "spec.source", str, required=True)
        if not uri.startswith("s3://") or len(uri) <= len("s3://"):
            raise SpecError("spec.source.uri", f"{uri!r} must start with s3://")
        digest = _get(source, "manifestDigest", "spec.source", str)
        residency = _get(spec, "residency", "spec", dict, {})
        warm = _get(residency, "warm", "spec.residency", str, DEFAULT_WARM)
        if warm not in WARM_TIERS:
            raise SpecError("spec.residency.warm", f"{warm!r} is not one of {WARM_TIERS}")
        rollout = _get(spec, "rollout", "spec", dict, {})
        return cls(
            base=_match(
                _get(base, "name", "spec.baseRef", str, required=True), NAME_PATTERN, "spec.baseRef.name"
            ),
            uri=uri,
            manifest_digest=_match(digest, DIGEST_PATTERN, "spec.source.manifestDigest") if digest else None,
            version=_match(
                _get(spec, "version", "spec", str, required=True), VERSION_PATTERN, "spec.version"
            ),
            pin=_get(residency, "pin", "spec.residency", bool, False),
            warm=warm,
            max_unavailable=_bounded(
                _get(rollout, "maxUnavailable", "spec.rollout", int, DEFAULT_MAX_UNAVAILABLE),
                1,
                MAX_REPLICAS,
                "spec.rollout.maxUnavailable",
            ),
        )
