"""One read of a safetensors file, then zero-copy views of its tensors.

The adapter loader reads each weights file with a single ``readinto`` (the GIL is released for the whole
read) and slices every tensor out of that one buffer, so parsing an adapter costs one syscall sequence and
a few large tensor ops instead of one small op per tensor.

Format: 8 bytes little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets}}``
(plus an optional ``__metadata__``), then the data; offsets are relative to the data's start.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_ELEM = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20


class SafetensorsFormatError(ValueError):
    """The bytes are not a well-formed safetensors file (the message says where)."""


def read_file(path: Path) -> memoryview:
    """The whole file in one buffer (one open, one read loop). The buffer is allocated uninitialised (a
    zero-filled ``bytearray`` would hold the GIL while it writes every page) and the GIL is released while
    the kernel copies."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        view = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break  # the file shrank under us: the header check below names it
            got += n
    return view[:got]


def read_file_direct(path: Path, align: int = 4096) -> memoryview:
    """The whole file read past the page cache (O_DIRECT, into a page-aligned buffer): what a read from the
    disk itself costs, whatever the cache holds. Linux only; benchmarks use it to time the disk tier."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        size = os.fstat(fd).st_size
        buf = mmap.mmap(-1, max(align, -(-size // align) * align))  # anonymous maps are page-aligned
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if not n:
                break
            got += n
    finally:
        os.close(fd)
    return view[: min(got, size)]


def read_header(path: Path) -> dict:
    """The JSON header alone (a few KiB): names, dtypes and shapes without reading the data."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= n <= MAX_HEADER_BYTES:
            raise SafetensorsFormatError(f"header length {n} is not a safetensors header")
        raw = f.read(n)
    if len(raw) != n:
        raise SafetensorsFormatError(f"header length {n} exceeds the file")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsFormatError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("header is not a JSON object")
    return header


Reader = Callable[[Path], memoryview]


def parse(buf: memoryview) -> dict[str, torch.Tensor]:
    """name -> tensor viewing ``buf`` (no copy; the views keep the buffer alive)."""
    if len(buf) < 8:
        raise SafetensorsFormatError(f"{len(buf)} bytes: shorter than the 8-byte header length")
    n = int.from_bytes(buf[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > len(buf):
        raise SafetensorsFormatError(f"header length {n} exceeds the file ({len(buf)} bytes)")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsFormatError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("header is not a JSON object")
    data = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    start, size = 8 + n, len(buf) - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor(name, entry, data, start, size)
    return out


def _tensor(name: str, entry, data: torch.Tensor, start: int, size: int) -> torch.Tensor:
    if not isinstance(entry, dict):
        raise SafetensorsFormatError(f"{name}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise SafetensorsFormatError(f"{name}: dtype {dtype!r} is none of {sorted(DTYPES)}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise SafetensorsFormatError(f"{name}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise SafetensorsFormatError(f"{name}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    elem = _ELEM[dtype]
    if not 0 <= begin <= end <= size:
        raise SafetensorsFormatError(
            f"{name}: data [{begin}, {end}) lies outside the {size} data bytes (truncated?)"
        )
    if end - begin != math.prod(shape) * elem:
        raise SafetensorsFormatError(f"{name}: {end - begin} bytes do not hold {dtype} {shape}")
    raw = data[start + begin : start + end]
    if (start + begin) % elem:  # a view must be aligned to its element size: copy the rare odd one
        raw = raw.clone()
    return raw.view(DTYPES[dtype]).view(shape)
