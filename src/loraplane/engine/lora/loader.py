"""Disk -> host loads of adapter versions: several at once, bounded in bytes, started in the order asked.

The scheduler asks for the adapters of queued requests oldest first, so submission order is arrival order:
a load starts as soon as the bytes of the loads in flight leave room for it (one always runs, whatever its
size). Parsing runs on worker threads and spends its time in a file read, a hash and a few large tensor
ops, all of which release the GIL, so the engine thread keeps stepping while adapters load. When a load
ends, ``on_done`` is called (the serving loop's wake-up: it may be blocked waiting for exactly this).

A remote version's load starts with its ``fetch`` (the pull of its files from S3 into the host cache) on the
same worker, so pulls share the loads' order and byte bound and never run on the engine thread.

Two asks for the same key share one load, unless the key was ``detach``ed between them: a version registered
again after an unload is another record with another source, and must never be handed the old one's load.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplane.engine.lora.weights import WEIGHTS_FILE, AdapterWeights

DEFAULT_WORKERS = 4
DEFAULT_MAX_BYTES = 2 << 30


@dataclass(slots=True, eq=False)  # a job is itself: two loads of one key are two jobs
class _Job:
    key: str
    folder: Path | None
    sha256: str | None
    file_id: tuple | None
    nbytes: int
    # brings the files first; returns their folder, and the weights' sha256 and file_id if it verified them
    fetch: Callable[[], tuple[Path, str | None, tuple | None]] | None = None
    future: Future = field(default_factory=Future)


class AdapterLoader:
    def __init__(
        self,
        parse: Callable[[Path, str | None, tuple | None], AdapterWeights],
        *,
        workers: int = DEFAULT_WORKERS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        one_cpu_thread: bool = False,
    ) -> None:
        """``one_cpu_thread``: each worker runs its tensor ops on one CPU thread (GPU hosts: several loads
        at once must not start a team of intra-op threads each and crowd out the engine thread's core)."""
        if workers < 1:
            raise ValueError(f"workers: must be at least 1, got {workers}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes: must be positive, got {max_bytes}")
        self.parse, self.max_bytes = parse, max_bytes
        self.on_done: Callable[[], None] | None = None
        self._pool = ThreadPoolExecutor(
            workers,
            thread_name_prefix="loraplane-adapter-load",
            initializer=_one_cpu_thread if one_cpu_thread else None,
        )
        self._lock = threading.Lock()
        self._queued: OrderedDict[_Job, None] = OrderedDict()  # waiting for room, in submission order
        self._running: set[_Job] = set()
        self._joinable: dict[str, _Job] = {}  # key -> the queued or running load a new ask for it shares
        self.in_flight_bytes = 0
        self.max_in_flight = 0  # the most loads that ran at once (tests, benchmarks)

    def submit(
        self, key: str, folder: Path, sha256: str | None = None, file_id: tuple | None = None
    ) -> Future:
        """Queue a load of ``folder`` (its result: AdapterWeights, or the parse's exception). ``sha256`` and
        ``file_id``: what the file hashed to, and its identity then (see ``load_adapter_weights``)."""
        try:
            nbytes = (Path(folder) / WEIGHTS_FILE).stat().st_size
        except OSError:
            nbytes = 0  # the parse names what is missing
        return self._queue(_Job(key, Path(folder), sha256, file_id, nbytes))

    def submit_fetch(
        self, key: str, fetch: Callable[[], tuple[Path, str | None, tuple | None]], nbytes: int
    ) -> Future:
        """Queue a load whose files ``fetch`` brings first (blocking, on the worker; its exception fails the
        load): it returns their folder, and the weights file's sha256 and file_id as ``submit`` takes them
        (None, None when it did not verify them); ``nbytes``: what it brings, counted against the bytes in
        flight like a file's size."""
        return self._queue(_Job(key, None, None, None, nbytes, fetch))

    def _queue(self, job: _Job) -> Future:
        with self._lock:
            old = self._joinable.get(job.key)
            if old is not None:
                return old.future
            self._queued[job] = None
            self._joinable[job.key] = job
            started = self._take()
        self._start(started)
        return job.future

    def detach(self, key: str) -> None:
        """Forget the load of ``key`` that a new ask would share (its version record was replaced): the next
        ask starts its own. A detached load still queued is cancelled (its record is gone); one running
        ends on its own, its result going only to the record that asked for it."""
        with self._lock:
            job = self._joinable.pop(key, None)
            if job is None or job not in self._queued:
                return
            del self._queued[job]
        job.future.cancel()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queued) + len(self._running)

    def _take(self) -> list[_Job]:
        """Jobs that may start now (under the lock): in order, while the bytes in flight leave room."""
        started = []
        while self._queued:
            job = next(iter(self._queued))
            if self._running and self.in_flight_bytes + job.nbytes > self.max_bytes:
                break
            del self._queued[job]
            self._running.add(job)
            self.in_flight_bytes += job.nbytes
            started.append(job)
        self.max_in_flight = max(self.max_in_flight, len(self._running))
        return started

    def _start(self, jobs: list[_Job]) -> None:
        for job in jobs:
            try:
                self._pool.submit(self._run, job)
            except RuntimeError as error:  # shut down
                job.future.set_exception(error)

    def _run(self, job: _Job) -> None:
        try:
            if job.fetch is not None:
                job.folder, job.sha256, job.file_id = job.fetch()
            weights = self.parse(job.folder, job.sha256, job.file_id)
        except BaseException as error:  # noqa: BLE001 - it belongs to the requests of this adapter
            job.future.set_exception(error)
        else:
            job.future.set_result(weights)
        with self._lock:
            self._running.discard(job)
            if self._joinable.get(job.key) is job:
                del self._joinable[job.key]
            self.in_flight_bytes -= job.nbytes
            started = self._take()
        self._start(started)
        if self.on_done is not None:
            self.on_done()

    def close(self) -> None:
        with self._lock:
            queued, self._queued = list(self._queued), OrderedDict()
            self._joinable.clear()
        for job in queued:
            job.future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _one_cpu_thread() -> None:
    # Sets this worker's OpenMP thread count; torch also takes it as the default of threads started later,
    # which on a GPU host run no CPU-heavy tensor work.
    torch.set_num_threads(1)
