"""The signed adapter manifest: what an adapter version is, for which base, and its exact bytes.

The manifest file stored next to the weights *is* its canonical form: JSON with sorted keys, compact
separators, UTF-8. Its sha256 (``"sha256:<hex>"``) is the adapter version's identity, so a reader
refuses a manifest whose bytes are not canonical: two spellings of one manifest would be two identities.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from loraplane.artifacts import errors as E

SCHEMA = "loraplane.dev/adapter-manifest/v1"
MANIFEST_FILE = "loraplane-manifest.json"
SIGNATURE_FILE = "loraplane-manifest.sig"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
REQUIRED_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE})
OPTIONAL_FILES = frozenset({"README.md"})  # PEFT's save_pretrained writes a model card
KNOWN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = frozenset({"float32", "float16", "bfloat16"})
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")

_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a Kubernetes resource name (DNS label)
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


def check_file_name(name: str, field_: str) -> None:
    """Refuse traversal, nesting, hidden, absurd and pickle file names (the reason says which)."""
    if not isinstance(name, str) or not _FILE_NAME.match(name) or ".." in name:
        raise E.ArtifactError(E.BAD_PATH, f"file name {name!r} is not a plain, short file name", field_)
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise E.ArtifactError(E.PICKLE_WEIGHTS, f"{name!r}: pickle-format weights are never loaded", field_)


def normalize_digest(value: str, field_: str = "manifestDigest") -> str:
    """``sha256:<hex>`` (a bare 64-hex string is accepted and prefixed)."""
    text = value.strip().lower() if isinstance(value, str) else ""
    hex_ = text.removeprefix("sha256:")
    if not _HEX64.match(hex_):
        raise E.ArtifactError(E.BAD_MANIFEST, f"{value!r} is not sha256:<64 hex digits>", field_)
    return "sha256:" + hex_


def normalize_base_hash(value: str, field_: str = "base_model_hash") -> str:
    """The 64-hex base hash (a ``sha256:`` prefix is accepted and dropped)."""
    return normalize_digest(value, field_).removeprefix("sha256:")


@dataclass(frozen=True, slots=True)
class FileEntry:
    sha256: str  # 64 lowercase hex digits
    size: int  # bytes

    def __post_init__(self):
        if not isinstance(self.sha256, str) or not _HEX64.match(self.sha256):
            raise E.ArtifactError(E.BAD_MANIFEST, f"sha256 {self.sha256!r} is not 64 lowercase hex", "sha256")
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
            raise E.ArtifactError(E.BAD_MANIFEST, f"size {self.size!r} is not a non-negative integer", "size")


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    version: str
    base_model_hash: str  # compute_base_hash() of the base the adapter was trained for
    ranks: MappingProxyType  # module -> LoRA rank (the largest over layers), e.g. {"q_proj": 8}
    alpha: float  # lora_alpha; scaling is alpha/r, or alpha/sqrt(r) with use_rslora
    target_modules: tuple[str, ...]  # sorted
    dtype: str  # float32 | float16 | bfloat16
    files: MappingProxyType  # file name -> FileEntry
    created: str  # UTC, 2026-11-30T06:40:00Z
    producer: str  # who wrote it, e.g. "loraplane 0.1.0"
    use_rslora: bool = False
    alphas: MappingProxyType | None = (
        None  # module -> lora_alpha PEFT uses for it (alpha_pattern); None: alpha
    )
    scales: MappingProxyType | None = None  # module -> the scale PEFT uses: alphas/r, or alphas/sqrt(r)
    schema: str = field(default=SCHEMA)

    def __post_init__(self):
        def bad(field_: str, message: str) -> E.ArtifactError:
            return E.ArtifactError(E.BAD_MANIFEST, message, f"manifest.{field_}")

        if self.schema != SCHEMA:
            raise bad("schema", f"unsupported schema {self.schema!r} (expected {SCHEMA!r})")
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise bad("name", f"{self.name!r} is not a DNS label (lowercase, digits, '-', max 63)")
        if not isinstance(self.version, str) or not _VERSION.match(self.version):
            raise bad("version", f"{self.version!r} is not a version ([A-Za-z0-9._-], max 63)")
        try:
            base = normalize_base_hash(self.base_model_hash, "manifest.base_model_hash")
        except E.ArtifactError as exc:
            raise bad("base_model_hash", exc.message) from None
        object.__setattr__(self, "base_model_hash", base)
        self._check_modules_and_ranks(bad)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not self.alpha > 0:
            raise bad("alpha", f"{self.alpha!r} is not a positive number")
        object.__setattr__(self, "alpha", float(self.alpha))
        if self.dtype not in DTYPES:
            raise bad("dtype", f"{self.dtype!r} is not one of {sorted(DTYPES)}")
        self._check_files(bad)
        if not isinstance(self.created, str) or not _TIMESTAMP.match(self.created):
            raise bad("created", f"{self.created!r} is not a UTC timestamp like 2026-11-30T06:40:00Z")
        if not isinstance(self.producer, str) or not 0 < len(self.producer) <= 200:
            raise bad("producer", "must be a non-empty string of at most 200 characters")
        if not isinstance(self.use_rslora, bool):
            raise bad("use_rslora", f"{self.use_rslora!r} is not a boolean")
        self._check_scaling(bad)

    def _check_scaling(self, bad) -> None:
        """Per-module alpha and scale; the scale must be what PEFT computes from rank and alpha."""
        alphas = {m: self.alpha for m in self.ranks} if self.alphas is None else self.alphas
        if not isinstance(alphas, dict | MappingProxyType) or set(alphas) != set(self.ranks):
            raise bad("alphas", "must give each module of ranks its lora_alpha")
        for module, alpha in alphas.items():
            if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
                raise bad(f"alphas.{module}", f"{alpha!r} is not a positive number")
        want = {
            m: float(a) / (math.sqrt(self.ranks[m]) if self.use_rslora else self.ranks[m])
            for m, a in alphas.items()
        }
        scales = want if self.scales is None else self.scales
        if not isinstance(scales, dict | MappingProxyType) or set(scales) != set(self.ranks):
            raise bad("scales", "must give each module of ranks its scale")
        for module, scale in scales.items():
            ok = not isinstance(scale, bool) and isinstance(scale, int | float)
            if not ok or not math.isclose(scale, want[module], rel_tol=1e-9):
                raise bad(
                    f"scales.{module}", f"{scale!r} is not alphas/{'sqrt(r)' if self.use_rslora else 'r'}"
                )
        object.__setattr__(self, "alphas", MappingProxyType({m: _number(alphas[m]) for m in sorted(alphas)}))
        object.__setattr__(self, "scales", MappingProxyType({m: _number(scales[m]) for m in sorted(scales)}))

    def _check_modules_and_ranks(self, bad) -> None:
        if not isinstance(self.ranks, dict | MappingProxyType) or not self.ranks:
            raise bad("ranks", "must be a non-empty object module -> rank")
        for module, rank in self.ranks.items():
            if not isinstance(module, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$", module):
                raise bad("ranks", f"module name {module!r} is not an identifier")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank <= 4096:
                raise bad(f"ranks.{module}", f"{rank!r} is not a rank in 1..4096")
        object.__setattr__(self, "ranks", MappingProxyType(dict(sorted(self.ranks.items()))))
        targets = (
            tuple(sorted(self.target_modules)) if isinstance(self.target_modules, list | tuple) else None
        )
        if not targets or len(set(targets)) != len(targets) or set(targets) != set(self.ranks):
            raise bad("target_modules", f"{self.target_modules!r} must list each module of ranks once")
        object.__setattr__(self, "target_modules", targets)

    def _check_files(self, bad) -> None:
        if not isinstance(self.files, dict | MappingProxyType):
            raise bad("files", "must be an object file name -> {sha256, size}")
        entries = {}
        for name, entry in self.files.items():
            check_file_name(name, f"manifest.files.{name}")
            if name in (MANIFEST_FILE, SIGNATURE_FILE):
                raise bad(f"files.{name}", "the manifest cannot list itself or its signature")
            if isinstance(entry, dict):
                try:
                    entry = FileEntry(**entry)
                except TypeError:
                    raise bad(f"files.{name}", "must have exactly the fields sha256 and size") from None
                except E.ArtifactError as exc:  # name the file: manifest.files.<name>.sha256 or .size
                    raise bad(f"files.{name}.{exc.field}", exc.message) from None
            if not isinstance(entry, FileEntry):
                raise bad(f"files.{name}", "must be {sha256, size}")
            entries[name] = entry
        missing = sorted(REQUIRED_FILES - set(entries))
        if missing:
            raise E.ArtifactError(
                E.MISSING_FILE, f"manifest does not list {missing}", f"manifest.files.{missing[0]}"
            )
        object.__setattr__(self, "files", MappingProxyType(dict(sorted(entries.items()))))

    def __reduce__(self):  # mapping proxies do not pickle; the canonical dict does
        return (Manifest.from_dict, (self.to_dict(),))

    # --- identity ------------------------------------------------------------------------------------

    @property
    def max_rank(self) -> int:
        return max(self.ranks.values())

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_dict(self) -> dict[str, Any]:
        alpha = int(self.alpha) if self.alpha.is_integer() else self.alpha  # 16, not 16.0: round-trips
        return {
            "schema": self.schema,
            "name": self.name,
            "version": self.version,
            "base_model_hash": self.base_model_hash,
            "ranks": dict(self.ranks),
            "alpha": alpha,
            "use_rslora": self.use_rslora,
            "alphas": dict(self.alphas),
            "scales": dict(self.scales),
            "target_modules": list(self.target_modules),
            "dtype": self.dtype,
            "files": {name: {"sha256": e.sha256, "size": e.size} for name, e in self.files.items()},
            "created": self.created,
            "producer": self.producer,
        }

    def canonical_bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.canonical_bytes()).hexdigest()

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise E.ArtifactError(E.BAD_MANIFEST, "the manifest is not a JSON object", "manifest")
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - names)
        if unknown:
            raise E.ArtifactError(E.BAD_MANIFEST, f"unknown field(s) {unknown}", f"manifest.{unknown[0]}")
        missing = sorted(
            n for n in names - set(data) if n not in ("use_rslora", "schema", "alphas", "scales")
        )
        if missing:
            raise E.ArtifactError(E.BAD_MANIFEST, "required field is missing", f"manifest.{missing[0]}")
        return cls(**data)

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Strict parse: unknown or missing fields, bad values and non-canonical bytes are refused."""
        try:
            parsed = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise E.ArtifactError(E.BAD_MANIFEST, f"not UTF-8 JSON ({exc})", "manifest") from None
        except RecursionError:
            raise E.ArtifactError(E.BAD_MANIFEST, "JSON nested too deeply", "manifest") from None
        manifest = cls.from_dict(parsed)
        if manifest.canonical_bytes() != data:
            raise E.ArtifactError(
                E.BAD_MANIFEST, "bytes are not canonical (sorted keys, compact separators, UTF-8)", "manifest"
            )
        return manifest


def _number(value: float) -> int | float:
    """16, not 16.0: an integral number is written as an integer, so the bytes round-trip."""
    return int(value) if float(value).is_integer() else float(value)


def canonical_json(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def digest_of(manifest_bytes: bytes) -> str:
    return "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
