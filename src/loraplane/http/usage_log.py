"""The usage log: one JSON line per finished request, appended to local files rotated by size.

Files are ``<dir>/usage-<seq>.jsonl`` (``seq`` 20 digits, from 1); the highest one is written, older ones are
only read. A restart appends to the highest file (after a newline if a kill cut its last line short), so the
log runs on across restarts. Rotation opens the next ``seq``; with ``keep`` > 0 the oldest files beyond that
many are deleted, with 0 none ever is.

Durability: each line is one ``os.write`` on an ``O_APPEND`` descriptor (no Python buffer), made when its
request ends and before the request's answer completes. Once written the line is in the OS page cache, which a
killed process (SIGKILL, the OOM killer, a crash) cannot take back: a dead server loses only the lines of the
requests still in flight. ``fsync`` is about the machine, not the process: a thread fsyncs the file every
``fsync_interval_s`` when lines were written since the last time, so a kernel crash or a power loss loses at
most that interval's lines; 0 leaves write-back to the OS (about 30 s on Linux). The event loop never waits
for a disk: a write into the page cache takes microseconds, and fsync runs on the thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

log = logging.getLogger("loraplane.http.usage")

_FILE = re.compile(r"usage-(\d{20})\.jsonl")
_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_FSYNC_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One request's use, as the log holds it (``adapter`` and ``version`` are null for the base model)."""

    time: float  # unix seconds when the request ended
    tenant: str  # the key's name from the keys file, or "anonymous" without keys
    adapter: str | None
    version: str | None
    prompt_tokens: int
    completion_tokens: int
    status: str  # ok | aborted (the client left) | error
    id: str = ""  # the answer's id (chatcmpl-..., cmpl-...), as the client saw it

    def line(self) -> bytes:
        fields = asdict(self)
        fields["time"] = round(self.time, 3)
        return (json.dumps(fields, separators=(",", ":")) + "\n").encode()

    @classmethod
    def parse(cls, line: bytes) -> UsageRecord | None:
        """None for a line that is not a record (a torn last line, say)."""
        try:
            fields = json.loads(line)
            return cls(**fields) if isinstance(fields, dict) else None
        except (ValueError, TypeError):
            return None


def parse_since(value: str) -> float:
    """``since`` as unix seconds: a number of seconds, or an RFC 3339 time with its offset."""
    value = value.strip()
    if _NUMBER.fullmatch(value):
        seconds = float(value)
        if math.isfinite(seconds):
            return seconds
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"since: expected unix seconds or an RFC 3339 time (2026-01-31T12:00:00Z), got {value[:64]!r}"
        ) from None
    if when.tzinfo is None:
        raise ValueError(f"since: an RFC 3339 time needs its offset (Z or +hh:mm), got {value[:64]!r}")
    return when.timestamp()


class UsageLog:
    def __init__(self, folder: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = 0,
                 fsync_interval_s: float = DEFAULT_FSYNC_INTERVAL_S) -> None:  # fmt: skip
        if max_bytes < 4096:
            raise ValueError(f"usage_log_max_bytes: must be at least 4096, got {max_bytes}")
        if keep < 0:
            raise ValueError(f"usage_log_keep: must be >= 0, got {keep}")
        if fsync_interval_s < 0:
            raise ValueError(f"usage_fsync_interval_s: must be >= 0, got {fsync_interval_s}")
        self.folder, self.max_bytes, self.keep = Path(folder), max_bytes, keep
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"usage_log_dir: cannot create {folder}: {exc.strerror}") from None
        self._lock = threading.Lock()
        self._retired: list[int] = []  # descriptors of rotated files, fsynced and closed by the sync thread
        self._dirty = False
        self.lines = self.failures = 0
        seqs = self._seqs()
        self._seq = seqs[-1] if seqs else 1
        self._fd, self._size = self._open(self._seq)
        self._stop = threading.Event()
        self._thread = None
        if fsync_interval_s > 0:
            self._thread = threading.Thread(target=self._sync_every, args=(fsync_interval_s,),
                                            name="usage-log-fsync", daemon=True)  # fmt: skip
            self._thread.start()

    def path(self, seq: int) -> Path:
        return self.folder / f"usage-{seq:020d}.jsonl"

    def _seqs(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _FILE.fullmatch(p.name)))

    def _open(self, seq: int) -> tuple[int, int]:
        try:
            fd = os.open(self.path(seq), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        except OSError as exc:
            raise ValueError(f"usage_log_dir: cannot write {self.path(seq)}: {exc.strerror}") from None
        size = os.fstat(fd).st_size
        if size and not _ends_with_newline(self.path(seq), size):
            size += os.write(fd, b"\n")  # a kill cut the last line short: it stays unparsable, alone
        return fd, size

    # --- writing (the event loop) ------------------------------------------------------------------------
    def append(self, record: UsageRecord) -> None:
        """Write one line now (into the page cache). A disk error is logged and counted, never raised: the
        request it describes has been served."""
        data = record.line()
        with self._lock:
            try:
                if self._size and self._size + len(data) > self.max_bytes:
                    self._rotate()
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view) :]
                self._size += len(data)
                self._dirty = True
                self.lines += 1
            except OSError as exc:
                self.failures += 1
                log.error(
                    "usage log write failed", extra={"fields": {"error": str(exc), "dir": str(self.folder)}}
                )

    def _rotate(self) -> None:
        self._retired.append(self._fd)
        self._seq += 1
        self._fd, self._size = self._open(self._seq)
        if self.keep:
            for seq in self._seqs()[: -self.keep]:
                self.path(seq).unlink(missing_ok=True)

    # --- fsync (its own thread) --------------------------------------------------------------------------
    def _sync_every(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sync()

    def sync(self) -> None:
        """fsync what was written so far (outside the lock: appends go on meanwhile)."""
        with self._lock:
            fd = os.dup(self._fd) if self._dirty else None
            retired, self._retired, self._dirty = self._retired, [], False
        for descriptor in [*retired, *([fd] if fd is not None else [])]:
            try:
                os.fsync(descriptor)
            except OSError as exc:
                log.error("usage log fsync failed", extra={"fields": {"error": str(exc)}})
            finally:
                os.close(descriptor)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sync()
        with self._lock:
            os.close(self._fd)

    # --- reading (a worker thread) -----------------------------------------------------------------------
    def read(self, since: float) -> Iterator[UsageRecord]:
        """Records of requests that ended at ``since`` or later, oldest file first. A file last modified
        before ``since`` holds only older lines and is skipped unread."""
        for seq in self._seqs():
            path = self.path(seq)
            try:
                if path.stat().st_mtime < since - 1.0:  # a second of slack for file-system time granularity
                    continue
                data = path.read_bytes()
            except FileNotFoundError:  # rotated away meanwhile
                continue
            for line in data.split(b"\n")[:-1]:  # the piece after the last newline may be mid-write
                record = UsageRecord.parse(line)
                if record is not None and record.time >= since:
                    yield record


def _ends_with_newline(path: Path, size: int) -> bool:
    with path.open("rb") as f:
        f.seek(size - 1)
        return f.read(1) == b"\n"


def query(log: UsageLog, since: float, tenant: str | None = None, adapter: str | None = None,
          limit: int = 1000) -> dict:  # fmt: skip
    """What ``GET /admin/usage`` answers: the matching records (the first ``limit``) and their totals per
    (tenant, adapter, version), over every matching record. Blocking: run it in a worker thread."""
    records, totals, matched = [], {}, 0
    for record in log.read(since):
        if (tenant is not None and record.tenant != tenant) or (
            adapter is not None and record.adapter != adapter
        ):
            continue
        matched += 1
        if len(records) < limit:
            records.append(asdict(record))
        total = totals.setdefault((record.tenant, record.adapter, record.version), [0, 0, 0])
        total[0] += 1
        total[1] += record.prompt_tokens
        total[2] += record.completion_tokens
    rows = [{"tenant": t, "adapter": a, "version": v, "requests": n, "prompt_tokens": p, "completion_tokens": c}
            for (t, a, v), (n, p, c) in sorted(totals.items(), key=lambda kv: tuple(map(str, kv[0])))]  # fmt: skip
    return {
        "since": since,
        "matched": matched,
        "truncated": matched > limit,
        "records": records,
        "totals": rows,
    }
