"""The base-model hash: the identity that every adapter's manifest records and every pod checks.

Definition (version 1), deterministic and independent of how the weights are sharded:

    sha256( b"loraplane-base-hash-v1\\n"
            + for each tensor, in ascending order of its name across all *.safetensors files:
                  f"{name}\\t{dtype}\\t{','.join(shape)}\\t{nbytes}\\n".encode() + raw little-endian bytes )

Only tensor content counts: file names, shard boundaries and safetensors ``__metadata__`` do not.
The same weights re-saved in another dtype are a different base, on purpose. Torch-free: the
safetensors header is parsed directly, and bytes stream through in chunks.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from loraplane.artifacts.errors import ArtifactError
from loraplane.artifacts.tensors import layout, parse_header

HASH_VERSION = b"loraplane-base-hash-v1\n"
_CHUNK = 8 << 20
_MAX_HEADER = 100 << 20


class BaseHashError(ValueError):
    """The folder is not a hashable safetensors model."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """Return (header without __metadata__, absolute offset where tensor data begins)."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise BaseHashError(f"{path.name}: too short to be safetensors")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > _MAX_HEADER:
            raise BaseHashError(f"{path.name}: header length {header_len} is absurd")
        try:
            header = parse_header(f.read(header_len), path.name)
        except ArtifactError as exc:
            raise BaseHashError(f"{path.name}: {exc.message}") from None
    header.pop("__metadata__", None)
    return header, 8 + header_len


def weight_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted({model_dir / name for name in _index_shards(index)})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BaseHashError(f"{model_dir}: no *.safetensors weights (pickle formats are not accepted)")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise BaseHashError(f"{model_dir}: index names missing shard(s) {missing}")
    return files


def _index_shards(index: Path) -> set[str]:
    """The shard file names of a ``model.safetensors.index.json``; a malformed index says which part."""
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise BaseHashError(f"{index.name}: unreadable ({type(exc).__name__})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BaseHashError(f"{index.name}: weight_map is missing or not a non-empty object")
    names = set(weight_map.values())
    for name in names:
        if (
            not isinstance(name, str)
            or "/" in name
            or name.startswith(".")
            or not name.endswith(".safetensors")
        ):
            raise BaseHashError(f"{index.name}: weight_map names {name!r}, not a .safetensors file beside it")
    return names


def tensor_entries(model_dir: Path) -> list[TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for path in weight_files(model_dir):
        header, data_start = read_safetensors_header(path)
        try:  # offsets inside the file, spans matching shape x dtype: a truncated shard fails here
            spans = layout(header, path.stat().st_size - data_start, path.name)
        except ArtifactError as exc:
            raise BaseHashError(f"{path.name}: {exc.message}") from None
        for span in spans:
            if span.name in entries:
                raise BaseHashError(
                    f"tensor {span.name!r} appears in both {entries[span.name].path.name} and {path.name}"
                )
            entries[span.name] = TensorEntry(
                span.name, span.dtype, span.shape, path, data_start + span.begin, span.end - span.begin
            )
    return [entries[name] for name in sorted(entries)]


def compute_base_hash(model_dir: str | Path) -> str:
    """The 64-hex-digit base hash of a Hugging Face safetensors model folder."""
    digest = hashlib.sha256(HASH_VERSION)
    handles: dict[Path, object] = {}
    try:
        for entry in tensor_entries(Path(model_dir)):
            shape = ",".join(str(d) for d in entry.shape)
            digest.update(f"{entry.name}\t{entry.dtype}\t{shape}\t{entry.nbytes}\n".encode())
            f = handles.get(entry.path) or handles.setdefault(entry.path, open(entry.path, "rb"))
            f.seek(entry.start)
            remaining = entry.nbytes
            while remaining:
                chunk = f.read(min(_CHUNK, remaining))
                if not chunk:
                    raise BaseHashError(f"{entry.path.name}: truncated inside tensor {entry.name!r}")
                digest.update(chunk)
                remaining -= len(chunk)
    finally:
        for f in handles.values():
            f.close()
    return digest.hexdigest()
