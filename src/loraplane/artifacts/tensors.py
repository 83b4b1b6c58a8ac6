"""Every byte of a safetensors file checked once, in the same pass that hashes it (torch- and numpy-free).

A safetensors file is ``u64 header length | JSON header | data``. The header maps each tensor name to
``{dtype, shape, data_offsets: [begin, end]}`` (offsets relative to the data). ``TensorScanner`` is fed
the file's bytes in order, in chunks of any size (a download stream or a local read), beside sha256:

- layout (``BadTensorLayout``): each tensor's byte span equals prod(shape) x itemsize, the spans tile
  the data exactly (no gap, no overlap, nothing outside the file, no trailing bytes), so truncated data,
  offsets of 10**12 and shapes that disagree with their span are refused before anything is read;
- content (``NonFiniteWeights``): no NaN or Inf in any floating-point tensor.

The finiteness test works on the exponent bytes only: a float is NaN or Inf exactly when its exponent
bits are all ones. ``bytes[i::w].translate(table)`` picks and classifies those bytes at C speed (a few
GB/s), so the check costs less than the sha256 it runs beside (bench: ``python -m
loraplane.artifacts.tensors --bench``).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loraplane.artifacts import errors as E

MAX_HEADER_BYTES = 100 << 20
CHUNK = 8 << 20
ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
# dtype -> (item size, byte holding the exponent's high bits, their mask, byte with the rest, its mask):
# the value is NaN or Inf exactly when both masked bytes are all ones (little-endian layout).
_EXPONENT = {
    "F64": (8, 7, 0x7F, 6, 0xF0),
    "F32": (4, 3, 0x7F, 2, 0x80),
    "BF16": (2, 1, 0x7F, 0, 0x80),
    "F16": (2, 1, 0x7C, None, 0),
    "F8_E5M2": (1, 0, 0x7C, None, 0),
    "F8_E4M3": (1, 0, 0x7F, None, 0),  # no Inf; S.1111.111 is its NaN
}
_TABLES = {m: bytes(1 if i & m == m else 0 for i in range(256)) for m in (0x7F, 0x80, 0xF0, 0x7C)}


@dataclass(frozen=True, slots=True)
class TensorSpan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int


def parse_header(raw: bytes, field_: str) -> dict:
    """The header JSON object; malformed or absurdly nested JSON is a BadTensorLayout, never a traceback."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise E.ArtifactError(E.BAD_TENSOR_LAYOUT, f"unreadable safetensors header ({exc})", field_) from None
    except RecursionError:
        raise E.ArtifactError(
            E.BAD_TENSOR_LAYOUT, "safetensors header is nested too deeply", field_
        ) from None
    if not isinstance(header, dict):
        raise E.ArtifactError(E.BAD_TENSOR_LAYOUT, "safetensors header is not a JSON object", field_)
    return header


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def layout(header: dict, data_bytes: int, field_: str) -> list[TensorSpan]:
    """The tensors in data order, after checking that their spans tile ``data_bytes`` exactly."""

    def bad(message: str) -> E.ArtifactError:
        return E.ArtifactError(E.BAD_TENSOR_LAYOUT, message, field_)

    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise bad(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(_is_count(d) for d in shape):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if end > data_bytes or begin > end:
            raise bad(
                f"tensor {name!r}: data_offsets {offsets} lie outside the {data_bytes} data bytes (truncated?)"
            )
        need = math.prod(shape) * ITEMSIZE[dtype]
        if end - begin != need:
            raise bad(
                f"tensor {name!r}: shape {shape} x {dtype} needs {need} bytes, data_offsets span {end - begin}"
            )
        spans.append(TensorSpan(name, dtype, tuple(shape), begin, end))
    spans.sort(key=lambda s: (s.begin, s.end))
    position = 0
    for span in spans:
        if span.begin != position:
            what = (
                "overlaps the previous tensor"
                if span.begin < position
                else f"leaves a gap at byte {position}"
            )
            raise bad(f"tensor {span.name!r}: data_offsets [{span.begin}, {span.end}] {what}")
        position = span.end
    if position != data_bytes:
        raise bad(f"{data_bytes - position} bytes after the last tensor belong to none")
    return spans


def read_layout(path: Path, field_: str) -> list[TensorSpan]:
    """The checked layout of a local file from its header alone (no tensor bytes are read)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise E.ArtifactError(E.BAD_TENSOR_LAYOUT, "too short to be safetensors", field_)
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise E.ArtifactError(
                E.BAD_TENSOR_LAYOUT, f"header length {length} exceeds the file or the limit", field_
            )
        header = parse_header(f.read(length), field_)
    return layout(header, size - 8 - length, field_)


def first_non_finite(data: bytes, dtype: str, start: int = 0, stop: int | None = None) -> int | None:
    """Index (from ``start``) of the first NaN/Inf element in ``data[start:stop]``, whole elements of
    ``dtype``, or None. Slicing with a step copies only the exponent bytes: no other copy is made."""
    test = _EXPONENT.get(dtype)
    if test is None:  # integers and bool: always finite
        return None
    width, hi, hi_mask, lo, lo_mask = test
    stop = len(data) if stop is None else stop
    flags = data[start + hi : stop : width].translate(_TABLES[hi_mask])
    if 1 not in flags:  # the common case: no exponent near its maximum
        return None
    if lo is not None:  # rare: huge values; the element is non-finite only if the other bits agree
        both = int.from_bytes(flags, "little") & int.from_bytes(
            data[start + lo : stop : width].translate(_TABLES[lo_mask]), "little"
        )
        if not both:
            return None
        return ((both & -both).bit_length() - 1) // 8
    return flags.index(1)


class TensorScanner:
    """Checks a safetensors file fed in order through ``update``; ``finish`` raises what it found.

    Problems are recorded, not raised, while bytes flow: a download checks its sha256 first, so that a
    transport fault is retried as one and only the signed bytes themselves are refused for their content.
    """

    def __init__(self, size: int, field_: str):
        self.size, self.field = size, field_
        self.error: E.ArtifactError | None = None
        self.spans: list[TensorSpan] | None = None
        self._head = bytearray()
        self._data_start = 0
        self._seen = 0  # bytes fed so far
        self._index = 0  # current span
        self._carry = b""  # a partial element at the end of the previous chunk

    def update(self, chunk: bytes) -> None:
        start, self._seen = self._seen, self._seen + len(chunk)
        if self.error is not None:
            return
        try:
            while self.spans is None and chunk:  # the length, then the header: buffered until complete
                need = (self._data_start or 8) - len(self._head)
                self._head += chunk[:need]
                taken = min(need, len(chunk))
                chunk, start = chunk[taken:], start + taken
                self._advance_head()
            if chunk:
                self._scan(chunk, start - self._data_start)
        except E.ArtifactError as exc:
            self.error = exc

    def _advance_head(self) -> None:
        if not self._data_start and len(self._head) == 8:
            (length,) = struct.unpack("<Q", self._head)
            if length > min(MAX_HEADER_BYTES, self.size - 8):
                raise E.ArtifactError(
                    E.BAD_TENSOR_LAYOUT, f"header length {length} exceeds the file or the limit", self.field
                )
            self._data_start = 8 + length
        if self._data_start and len(self._head) == self._data_start:
            header = parse_header(bytes(self._head[8:]), self.field)
            self.spans = layout(header, self.size - self._data_start, self.field)

    def _scan(self, chunk: bytes, offset: int) -> None:
        """``chunk`` starts ``offset`` bytes into the data section."""
        spans = self.spans
        pos = 0
        while pos < len(chunk) and self._index < len(spans):
            span = spans[self._index]
            take = min(len(chunk) - pos, span.end - (offset + pos))
            width = ITEMSIZE[span.dtype]
            if self._carry:  # complete the element split by the previous chunk
                fill = min(width - len(self._carry), take)
                self._carry += chunk[pos : pos + fill]
                if len(self._carry) == width:
                    self._check(
                        self._carry, 0, width, span, (offset + pos + fill - width - span.begin) // width
                    )
                    self._carry = b""
                pos, take = pos + fill, take - fill
            whole = take - take % width
            self._check(chunk, pos, pos + whole, span, (offset + pos - span.begin) // width)
            self._carry += chunk[pos + whole : pos + take]
            pos += take
            if offset + pos >= span.end:
                self._index += 1

    def _check(self, data: bytes, start: int, stop: int, span: TensorSpan, first_element: int) -> None:
        bad = first_non_finite(data, span.dtype, start, stop)
        if bad is not None:
            raise E.ArtifactError(
                E.NON_FINITE_WEIGHTS,
                f"tensor {span.name!r} element {first_element + bad} is NaN or Inf",
                self.field,
            )

    def finish(self) -> None:
        if self.error is None and self._seen != self.size:
            self.error = E.ArtifactError(
                E.BAD_TENSOR_LAYOUT, f"{self._seen} bytes, expected {self.size}", self.field
            )
        if self.error is None and self.spans is None:
            self.error = E.ArtifactError(E.BAD_TENSOR_LAYOUT, "too short to be safetensors", self.field)
        if self.error is not None:
            raise self.error


def hash_and_check(path: Path, field_: str | None = None, expected: str | None = None) -> str:
    """sha256 hex of a local safetensors file, checking layout and finiteness in the same read.

    With ``expected``, a different hash is returned without judging the content: the caller reports the
    changed file (FileHashMismatch), which says more than what the changed bytes happen to hold."""
    path = Path(path)
    digest, scanner = hashlib.sha256(), TensorScanner(path.stat().st_size, field_ or path.name)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            scanner.update(chunk)
    if expected is None or digest.hexdigest() == expected:
        scanner.finish()
    return digest.hexdigest()


def _sha256_chunked(path) -> str:  # pragma: no cover - the baseline of _bench: verify.sha256_file's loop
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _bench(megabytes: int = 256) -> dict:  # pragma: no cover - a measurement, run by hand
    import os
    import random
    import tempfile

    rng = random.Random(0)
    values = struct.pack("<1024f", *(rng.gauss(0, 0.02) for _ in range(1024)))
    data = values * (megabytes * 256)
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [len(data) // 4], "data_offsets": [0, len(data)]}}
    ).encode()
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(struct.pack("<Q", len(header)) + header + data)
    try:
        results = {}
        for label, fn in (
            ("sha256_only", _sha256_chunked),
            ("sha256_and_check", hash_and_check),
        ):
            fn(f.name)  # warm the page cache
            t0 = time.perf_counter()
            fn(f.name)
            results[label + "_s"] = round(time.perf_counter() - t0, 4)
        t0 = time.perf_counter()
        for i in range(0, len(data), CHUNK):
            first_non_finite(data[i : i + CHUNK], "F32")
        results["check_only_s"] = round(time.perf_counter() - t0, 4)
        results["megabytes"] = megabytes
        results["check_gb_per_s"] = round(megabytes / 1024 / results["check_only_s"], 2)
        return results
    finally:
        os.unlink(f.name)


if __name__ == "__main__":  # pragma: no cover
    if "--bench" in sys.argv:
        print(json.dumps(_bench()))
