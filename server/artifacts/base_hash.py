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
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BaseHashError(f"{path.name}: unreadable safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise BaseHashError(f"{path.name}: safetensors header is not an object")
    header.pop("__metadata__", None)
    return header, 8 + header_len


def weight_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BaseHashError(f"{model_dir}: no *.safetensors weights (pickle formats are not accepted)")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise BaseHashError(f"{model_dir}: index names missing shard(s) {missing}")
    return files


def tensor_entries(model_dir: Path) -> list[TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for path in weight_files(model_dir):
        header, data_start = read_safetensors_header(path)
        for name, info in header.items():
            if name in entries:
                raise BaseHashError(
                    f"tensor {name!r} appears in both {entries[name].path.name} and {path.name}"
                )
            begin, end = info["data_offsets"]
            entries[name] = TensorEntry(
                name, info["dtype"], tuple(info["shape"]), path, data_start + begin, end - begin
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
