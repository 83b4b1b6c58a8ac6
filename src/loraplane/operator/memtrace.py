"""An opt-in memory trace of the operator process, for finding what it keeps (off unless asked for).

``LORAPLANE_TRACEMALLOC=FILE`` starts ``tracemalloc`` at startup; each SIGUSR1 then appends to FILE the
process's RSS, the traced total, and the lines whose allocations grew most since the previous SIGUSR1 and
since the first one. A test harness signals the process after each event it suspects (a server pod
replaced, say) and reads which lines keep what. Tracing slows every allocation: never set it in production.

The dump takes seconds on a large heap, so the signal handler only asks for one: a thread of its own makes
it, while the event loop goes on; signals that come during a dump make one more dump after it, never a
second one at once.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "LORAPLANE_TRACEMALLOC"
FRAMES = 8  # enough to see which caller of a library kept an allocation
TOP = 25  # lines per diff


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _short(filename: str) -> str:
    """A path from its package on (site-packages/aiohttp/x.py -> aiohttp/x.py)."""
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


class Tracer:
    """Snapshots on demand; each dump compares with the previous and the first snapshot."""

    def __init__(self, path: Path, frames: int = FRAMES):
        self.path = path
        tracemalloc.start(frames)
        self.first: tracemalloc.Snapshot | None = None
        self.previous: tracemalloc.Snapshot | None = None
        self.count = 0
        self._dumping = threading.Lock()  # one dump at a time, whoever asks

    def dump(self, *_) -> bool:
        """Append one dump to the file; False (nothing written) when another dump is under way."""
        if not self._dumping.acquire(blocking=False):
            return False
        try:
            self._dump()
        finally:
            self._dumping.release()
        return True

    def _dump(self) -> None:
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib*")]
        )
        traced, peak = tracemalloc.get_traced_memory()
        lines = [f"=== dump {self.count} at {time.time():.1f}: rss {_rss_bytes() / 2**20:.2f} MiB, "
                 f"traced {traced / 2**20:.2f} MiB (peak {peak / 2**20:.2f})"]  # fmt: skip
        for label, base in (("since previous", self.previous), ("since first", self.first)):
            if base is None:
                continue
            lines.append(f"--- top growth {label}")
            for stat in snapshot.compare_to(base, "traceback")[:TOP]:
                # most recent frame first: where the block was allocated, then its callers
                where = " <- ".join(f"{_short(f.filename)}:{f.lineno}" for f in reversed(stat.traceback))
                lines.append(f"{stat.size_diff:+9d} B {stat.count_diff:+6d} blocks  {where}")
        lines.extend(_census())
        with self.path.open("a") as out:
            out.write("\n".join(lines) + "\n")
        self.first = self.first or snapshot
        self.previous = snapshot
        self.count += 1


def _census(shown: int = 12) -> list[str]:
    """Live Kubernetes objects (dicts with kind and metadata) by kind and name, and what holds one of the
    most repeated: a name listed many times is an object kept in many copies, or one that outlived itself."""
    bodies = [o for o in gc.get_objects()
              if type(o) is dict and isinstance(o.get("metadata"), dict) and isinstance(o.get("kind"), str)]  # fmt: skip
    names = Counter((o["kind"], o["metadata"].get("name")) for o in bodies)
    lines = [f"--- live objects: {len(bodies)}, by kind {dict(Counter(k for k, _ in names.elements()))}"]
    lines += [f"{count:6d}  {kind}/{name}" for (kind, name), count in names.most_common(shown)]
    if names:
        (kind, name), _ = names.most_common(1)[0]
        sample = next(o for o in bodies if (o["kind"], o["metadata"].get("name")) == (kind, name))
        for holder in gc.get_referrers(sample)[:6]:
            if holder is bodies:
                continue
            what = type(holder).__name__
            if isinstance(holder, dict):
                what += f" keys {list(holder)[:6]}"
            lines.append(f"  {kind}/{name} held by {what}")
    return lines


class Dumper:
    """Makes ``dump`` in a thread of its own when asked; ``request`` may be a signal handler: it only queues
    (``SimpleQueue.put`` is reentrant, so a signal that interrupts another request cannot deadlock it)."""

    def __init__(self, dump):
        self._dump = dump
        self._requests: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.dumps = 0  # dumps made
        self.merged = 0  # requests answered by a dump made for an earlier one
        threading.Thread(target=self._serve, name="memtrace", daemon=True).start()

    def request(self, *_) -> None:
        self._requests.put(None)

    def _serve(self) -> None:
        while True:
            self._requests.get()
            while True:  # requests that came while the last dump ran: this one dump answers them all
                try:
                    self._requests.get_nowait()
                    self.merged += 1
                except queue.Empty:
                    break
            try:
                self._dump()
            except Exception:  # the thread must outlive a failed dump: the next signal tries again
                log.exception("the memory trace failed")
            self.dumps += 1


def install_from_env() -> Tracer | None:
    """Start the trace and hook SIGUSR1 when ``LORAPLANE_TRACEMALLOC`` names a file; else nothing."""
    path = os.environ.get(ENV)
    if not path:
        return None
    tracer = Tracer(Path(path))
    signal.signal(signal.SIGUSR1, Dumper(tracer.dump).request)  # before the event loop exists (kopf.run)
    return tracer
