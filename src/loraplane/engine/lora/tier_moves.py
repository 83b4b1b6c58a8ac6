"""How an adapter version's weights move between the tiers (remote -> disk -> host -> GPU), and when they may
be evicted.

``TierMoves`` is a base of ``AdapterTiers`` (manager.py), which keeps the registry and the step metadata; it
works on the manager's ``versions``, ``wanted``, ``unloading``, ``step_keys``, tiers (``gpu``, ``host``) and
``loader``, under its ``lock``. Everything here runs on the engine thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

from loraplane.engine.api import AdapterError
from loraplane.engine.lora import remote
from loraplane.engine.lora.version import AdapterVersion, known_sha256


class TierMoves:
    """Moving weights toward the GPU and freeing them (engine thread); a base of ``AdapterTiers``."""

    def _host_evictable(self, key: str) -> bool:
        """A host copy is kept for what is pinned, and for what requests use or wait for until it has GPU
        rows. Once it has them the GPU copy serves every step (in use, it cannot be evicted there), and a
        copy still landing keeps its own source alive: holding the host block as well for the requests'
        whole life would fill the host tier with adapters already on the GPU, and make every new load wait
        for room that only their requests' end gives back."""
        v = self.versions.get(key)
        if v is None or v.pinned:
            return v is None
        if key in self.gpu.slots:
            return True
        return not (v.refs or v.in_flight or key in self.wanted)

    def _gpu_evictable(self, key: str) -> bool:
        v = self.versions.get(key)
        return v is None or not (v.pinned or v.refs or v.in_flight or key in self.step_keys)

    def _requested(self, key: str) -> bool:
        v = self.versions.get(key)
        return v is not None and v.in_flight > 0

    def _frees_up(self, key: str) -> bool:
        """Evictable once the requests running on it end: not pinned, and no request of it still queued (an
        adapter whose queue keeps filling may never free its rows, and nobody should wait behind that)."""
        v = self.versions.get(key)
        return v is None or not (v.pinned or v.in_flight > v.refs)

    def _advance(self, key: str, queued: bool = True) -> bool:
        """One non-blocking move toward the GPU; True once it is usable there. ``queued``: it takes GPU room
        in its turn (LoadQueue); warm-ups and the step's own adapters (``ensure_resident``) do not wait."""
        v = self.versions[key]
        if self.gpu.done(key):
            self.wanted.discard(key)
            if key in self.gpu.copy_s:
                v.timings["gpu_copy"] = self.gpu.copy_s.pop(key)
            return True
        if self.gpu.holds(key) or v.state == "failed":
            return False  # copy in flight, or it cannot be loaded again
        weights = self.host.get(key)
        if weights is None:
            if v.loading is None:
                if v.hashing is not None and not v.hashing.done():
                    # The reload is checked against the first read's hash: never wait for it here.
                    return False
                v.loading = self._start_load(key, v)
            if not v.loading.done():
                return False
            future, v.loading = v.loading, None
            try:
                weights = future.result()
            except Exception as error:  # noqa: BLE001 - the folder changed or vanished under us
                reason = error.reason if isinstance(error, AdapterError) else "BadAdapterFile"
                v.state, v.error, v.error_reason = "failed", f"{reason}: {error}", reason
                return False
            v.timings.update({f"disk_{k}": t for k, t in weights.timings.items()})
            if v.sha256 is None:  # registered on disk: its first read fixes the bytes (hashed off this path)
                v.sha256, v.hashing = weights.sha256, weights.hashing
                if v.hashing is not None:  # a reload waiting for it is noticed at once
                    v.hashing.add_done_callback(lambda _done: self._loaded())
            # What this read hashed to (or the first read's hash, still running, will): a later read of
            # the same unwritten file need not hash it again.
            v.file_id = weights.file_id
            self.host.put(key, weights, self._host_evictable)
        if queued and not self.wanted.may_take_room(key, self._requested):
            return False
        if not self.gpu.make_room(weights, self._gpu_evictable):
            if queued:  # waits in line only for room that the running requests' end will give
                self.wanted.waits_for_room(key, self.gpu.make_room(weights, self._frees_up, dry_run=True))
            return False
        self.wanted.waits_for_room(key, False)
        start = time.perf_counter()
        self.gpu.start_copy(key, weights)
        v.timings["gpu_copy_issue"] = time.perf_counter() - start
        return self.gpu.done(key)

    def _start_load(self, key: str, v: AdapterVersion) -> Future:
        """Hand the version's load to the loader: a remote one's starts with the pull of its files."""
        if v.folder is None:
            return self.loader.submit_fetch(key, lambda: self._fetch(key, v), v.remote.nbytes)
        return self.loader.submit(key, v.folder, known_sha256(v), v.file_id)

    def _fetch(self, key: str, v: AdapterVersion) -> tuple[Path, str | None, tuple | None]:
        """A remote version's pull (a loader worker): its folder, and the weights file's digest and identity
        when the pull verified them (the parse then hashes the file only if it changed since). Its folder is
        kept, so a reload after the host tier dropped it reads the disk and never pulls again."""
        start = time.perf_counter()
        folder, weights = remote.fetch(key, v.remote, v.digest)
        # No lock: the engine thread may hold it while it waits for this very load (ensure_resident), and
        # it reads the folder only once the load's future is done. Two attribute stores need none.
        v.timings["pull"] = time.perf_counter() - start
        v.folder = folder
        return (folder, weights.sha256, weights.file_id) if weights is not None else (folder, None, None)

    def poll(self) -> None:
        """Advance every pending load and free unloaded versions nothing uses any more."""
        with self.lock:
            for key in list(self.wanted):
                if key not in self.versions:
                    self.wanted.discard(key)
                else:
                    self._advance(key)
            for key in list(self.unloading):  # not every version: poll runs before every step
                v = self.versions.get(key)
                if v is None or not v.unloading:
                    self.unloading.discard(key)
                elif not v.refs and not v.in_flight and key not in self.step_keys:
                    if self.gpu.holds(key):
                        self.gpu.evict(key)
                    self.host.drop(key)
                    self.wanted.discard(key)
                    self.unloading.discard(key)
                    del self.versions[key]

    def ensure_resident(self, keys) -> None:
        """Block until every key is usable on the GPU (warm-up, and steps the scheduler did not gate)."""
        with self.lock:
            for key in keys:
                v = self.versions.get(key)
                if v is None:
                    raise AdapterError("AdapterNotFound", f"adapter {key!r} is not loaded")
                while not self._advance(key, queued=False):
                    if v.loading is not None:
                        v.loading.exception()  # wait for the parse
                    elif v.hashing is not None and not v.hashing.done():
                        v.hashing.exception()  # a reload is checked against the first read's hash
                    elif self.gpu.holds(key):
                        self.gpu.wait(key)
                    else:
                        raise AdapterError(
                            "AdapterInUse" if v.state != "failed" else "WarmFailed",
                            f"adapter {key!r} cannot be made GPU-resident: {v.error or 'the pool is held by others'}",
                        )
