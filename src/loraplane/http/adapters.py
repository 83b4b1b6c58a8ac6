"""``AdapterRegistry``: the pod's adapter lifecycle behind the admin API: pull -> verify -> load -> warm -> (serve).

A disk version (``warm: "disk"``) stops once pulled and verified: the engine registers its local folder on
the disk tier, and its first request loads it. A lazy version (``warm: "lazy"``) stops after its signed
manifest is verified: the engine registers it on its
remote tier with a fetch (this registry's pull, run by the engine's loader when a request first needs it), so
a pod can take thousands of versions without pulling one. Once pulled it is an ordinary disk-tier version.

One ``Entry`` per name@version, each driven by at most one asyncio task at a time, so concurrent PUTs of a
version share one download (the host cache also locks per adapter and per blob, across processes).
A failed attempt leaves nothing behind: the engine unloads what it loaded, the host cache entry is released
and unpinned, and the entry keeps only its error (what GET shows and the operator copies into conditions);
the next PUT tries again. Timings of each phase are kept per entry and observed in the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.artifacts import errors as E
from loraplane.engine.api import AdapterError, AdapterInfo, RemoteAdapter, adapter_key
from loraplane.http.metrics import Metrics

log = logging.getLogger("loraplane.http.adapters")

PULLING, CACHED, LOADED, WARM, FAILED = "pulling", "cached", "loaded", "warm", "failed"
PULL_FAILED, WARM_FAILED, POD_FAILED = "PullFailed", "WarmFailed", "PodFailed"
# Artifact reasons that are about the way to the artifact (or this pod), not the artifact: 500 PullFailed.
_PULL_REASONS = frozenset({E.SOURCE_UNREACHABLE, E.ACCESS_DENIED, E.NOT_FOUND, E.CACHE_FULL, E.BAD_URI})
_CONFLICTS = frozenset({E.BASE_MISMATCH, "AdapterConflict"})


class LoadFailed(Exception):
    """A load attempt failed: HTTP status, CamelCase reason and a message naming what."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def failure_of(exc: BaseException) -> LoadFailed:
    """Map any failure of a load to the contract's status and reason (docs/operator.md)."""
    if isinstance(exc, LoadFailed):
        return exc
    if isinstance(exc, E.ArtifactError):
        message = f"{exc.field}: {exc.message}" if exc.field else exc.message
        if exc.reason in _PULL_REASONS:
            return LoadFailed(500, PULL_FAILED, f"{exc.reason}: {message}")
        return LoadFailed(409 if exc.reason in _CONFLICTS else 422, exc.reason, message)
    if isinstance(exc, AdapterError):
        if exc.reason == "WarmFailed":
            return LoadFailed(500, WARM_FAILED, exc.message)
        if exc.reason in _PULL_REASONS or exc.reason == PULL_FAILED:  # a lazy version's pull, in the engine
            return LoadFailed(500, PULL_FAILED, exc.message)  # the message names the first reason
        return LoadFailed(409 if exc.reason in _CONFLICTS else 422, exc.reason, exc.message)
    return LoadFailed(500, POD_FAILED, f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    name: str
    version: str
    uri: str
    digest: str | None  # the pinned manifest digest ("sha256:<hex>"), or None
    pin: bool = False
    gpu: bool = True  # what `warm` asked for (the warm-up forward runs on the device either way)
    lazy: bool = False  # `warm: "lazy"`: register from the manifest; the first request pulls it
    disk: bool = False  # `warm: "disk"`: pull now, register on the disk tier; the first request loads it

    @property
    def deferred(self) -> bool:
        """Not warmed by its PUT (lazy or disk): done once registered, its first request loads it."""
        return self.lazy or self.disk


@dataclass(slots=True)
class Entry:
    spec: LoadSpec
    state: str = PULLING
    digest: str | None = None  # known once the manifest verified
    error: LoadFailed | None = None
    timings: dict[str, float] = field(default_factory=dict)
    cache_digest: str | None = None  # the host cache entry this version holds in use
    task: asyncio.Task | None = None
    since: float = field(default_factory=time.time)
    # A lazy version's pull runs on an engine loader thread: it hands its cache entry over under this lock,
    # and gives it straight back once the entry was let go (unloaded while pulling).
    hold_lock: threading.Lock = field(default_factory=threading.Lock)
    let_go: bool = False

    @property
    def key(self) -> str:
        return adapter_key(self.spec.name, self.spec.version)


class AdapterRegistry:
    """Owns the entries; every method runs on the event loop thread."""

    def __init__(self, engine, metrics: Metrics, puller, release, pin_cache, inspect=None) -> None:
        """``puller(spec)`` (blocking, run in a thread) returns a verified local folder (``path``, ``digest``,
        ``download_s``, ``verify_s``, and ``weights``: the weights file's ``VerifiedFile`` or None) held in use; ``release(digest)`` and ``pin_cache(digest, pinned)`` act
        on that host-cache entry. ``inspect(spec)`` (blocking) verifies the manifest alone and returns its
        ``digest``, ``ranks`` and ``nbytes``: what a lazy registration needs (without it, none is taken)."""
        self.engine, self.metrics = engine, metrics
        self._pull, self._release, self._pin_cache = puller, release, pin_cache
        self._inspect = inspect
        self.entries: dict[str, Entry] = {}

    # --- PUT ----------------------------------------------------------------------------------------------
    async def ensure(self, spec: LoadSpec, wait_s: float) -> Entry:
        """Start (or join) the load of ``spec``; wait up to ``wait_s`` for it to finish."""
        key = adapter_key(spec.name, spec.version)
        entry = self.entries.get(key)
        held = entry and (entry.digest or entry.spec.digest)
        if entry is not None and held and spec.digest and held != spec.digest:
            if entry.state != FAILED:
                raise LoadFailed(409, "AdapterConflict", f"{key} is held with manifest digest {held}, "
                                 f"not {spec.digest}; unload it first")  # fmt: skip
            entry = None
        if entry is not None and self._pull_failed(entry):
            await self.unload(spec.name, spec.version)  # its first request's pull failed: this PUT retries
            entry = None
        if entry is None or (entry.state == FAILED and (entry.task is None or entry.task.done())):
            entry = self.entries[key] = Entry(spec)
            entry.task = asyncio.create_task(self._load(entry), name=f"load {key}")
        elif entry.spec.pin != spec.pin and entry.state in (LOADED, WARM):
            await self.set_pin(spec.name, spec.version, spec.pin)
        if entry.spec.deferred and not spec.deferred and entry.state == LOADED and entry.task.done():
            entry.spec = LoadSpec(**{**_fields(spec), "pin": entry.spec.pin})  # asked warm now: warm it up
            entry.task = asyncio.create_task(self._warm_lazy(entry), name=f"warm {key}")
        if entry.task is not None and not entry.task.done():
            await asyncio.wait({entry.task}, timeout=wait_s)
        return entry

    def _pull_failed(self, entry: Entry) -> bool:
        """A lazy version whose pull failed in the engine (the engine marked it failed, not this entry)."""
        if not entry.spec.lazy or entry.state != LOADED:
            return False
        info = self.usable(entry.spec.name, entry.spec.version)
        return info is not None and info.state == FAILED

    async def _load(self, entry: Entry) -> None:
        spec, loaded = entry.spec, False
        try:
            if spec.lazy:
                await self._register_remote(entry)
                return
            started = time.perf_counter()
            local = await asyncio.to_thread(self._pull, spec)
            entry.cache_digest, entry.digest = local.digest, local.digest
            self._phase(entry, "download", getattr(local, "download_s", time.perf_counter() - started))
            self._phase(entry, "verify", getattr(local, "verify_s", 0.0))
            entry.state = CACHED
            started = time.perf_counter()
            await self.engine.load_adapter(spec.name, spec.version, Path(local.path), local.digest, pin=spec.pin,
                                           expected_base_hash=self.engine.info().base_hash, on_disk=spec.disk)  # fmt: skip
            loaded = True
            self._phase(entry, "load", time.perf_counter() - started)
            self.metrics.loads.inc()
            entry.state = LOADED
            if spec.disk:  # on this node's disk, verified: the first request loads it
                await self._serve_if_first(spec)
                return
            await self._warm(entry)
        except BaseException as exc:
            await self._fail(entry, exc, loaded)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            entry.since = time.time()

    async def _warm(self, entry: Entry) -> None:
        spec = entry.spec
        started = time.perf_counter()
        # A version is warm only once a real forward ran through it, so the warm-up runs on the device
        # whatever ``warm`` asked; "host" only means the pod need not keep it there (the tiers' LRU decides).
        await self.engine.warm_adapter(spec.name, spec.version, gpu=True)
        self._phase(entry, "warm", time.perf_counter() - started)
        if spec.pin and entry.cache_digest is not None:
            self._pin_cache(entry.cache_digest, True)
        await self._serve_if_first(spec)
        entry.state = WARM
        log.info("adapter ready", extra={"fields": {"adapter": entry.key, "digest": entry.digest,
                                                    "timings": entry.timings}})  # fmt: skip

    async def _serve_if_first(self, spec: LoadSpec) -> None:
        """The first version of a name serves at once: the alias goes to it when none is set."""
        if self.engine.resolve(spec.name) is None:
            await self.engine.set_alias(spec.name, spec.version)

    async def _warm_lazy(self, entry: Entry) -> None:
        """A lazy or disk version asked warm by a later PUT: the engine loads it (a lazy one pulled first, on
        its loader) and warms it."""
        try:
            await self._warm(entry)
        except BaseException as exc:
            await self._fail(entry, exc, loaded=True)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            entry.since = time.time()

    async def _register_remote(self, entry: Entry) -> None:
        """Verify the manifest alone and register the version on the engine's remote tier."""
        spec = entry.spec
        if self._inspect is None:
            raise LoadFailed(500, POD_FAILED, "warm: lazy registration needs a host cache (--host-cache-dir)")
        started = time.perf_counter()
        manifest = await asyncio.to_thread(self._inspect, spec)
        entry.digest = manifest.digest
        entry.timings["manifest"] = round(time.perf_counter() - started, 6)
        loop = asyncio.get_running_loop()
        remote = RemoteAdapter(lambda: self._fetch(entry, loop), dict(manifest.ranks), manifest.nbytes)
        await self.engine.register_remote_adapter(spec.name, spec.version, manifest.digest, remote, pin=spec.pin,
                                                  expected_base_hash=self.engine.info().base_hash)  # fmt: skip
        self.metrics.loads.inc()
        await self._serve_if_first(spec)
        entry.state = LOADED

    def _fetch(self, entry: Entry, loop: asyncio.AbstractEventLoop):
        """The engine's fetch of a lazy version (a loader thread): pull and verify into the host cache, and
        hand the entry it holds in use to ``entry`` (released at unload)."""
        try:  # pinned to the manifest verified at registration: a re-pushed URI is refused before its files
            local = self._pull(LoadSpec(**{**_fields(entry.spec), "digest": entry.digest}))
        except Exception as exc:
            _tell(loop, self._refused, entry, exc)
            raise  # the engine fails the version's requests with its reason
        with entry.hold_lock:
            kept = not entry.let_go
            if kept:
                entry.cache_digest = local.digest
        if not kept:
            self._release(local.digest)
            raise AdapterError("AdapterNotFound", f"{entry.key} was unloaded while it was pulled")
        _tell(loop, self._pulled, entry, local)
        return local.path, local.digest, getattr(local, "weights", None)  # the engine need not hash it again

    def _pulled(self, entry: Entry, local) -> None:
        self._phase(entry, "download", local.download_s)
        self._phase(entry, "verify", local.verify_s)

    def _refused(self, entry: Entry, exc: Exception) -> None:
        """A lazy version's pull failed: counted and shown like a failed PUT (the engine marked it failed)."""
        entry.error = failure_of(exc)
        self.metrics.load_failures.labels(entry.error.reason).inc()
        if isinstance(exc, E.ArtifactError) and exc.reason not in _PULL_REASONS:
            self.metrics.verify_failures.labels(exc.reason).inc()
        log.warning("adapter pull failed", extra={"fields": {"adapter": entry.key,
                    "reason": entry.error.reason, "detail": entry.error.message}})  # fmt: skip

    async def _fail(self, entry: Entry, exc: BaseException, loaded: bool) -> None:
        """Record why the attempt failed, and leave nothing of it behind."""
        entry.error = failure_of(exc) if not isinstance(exc, asyncio.CancelledError) else LoadFailed(
            500, POD_FAILED, "the load was cancelled (unloaded while loading)")  # fmt: skip
        entry.state = FAILED
        self.metrics.load_failures.labels(entry.error.reason).inc()
        if isinstance(exc, E.ArtifactError) and exc.reason not in _PULL_REASONS:
            self.metrics.verify_failures.labels(exc.reason).inc()
        log.warning("adapter load failed", extra={"fields": {"adapter": entry.key,
                    "reason": entry.error.reason, "detail": entry.error.message}})  # fmt: skip
        await self._undo(entry, loaded)

    async def _undo(self, entry: Entry, loaded: bool) -> None:
        """Nothing half-loaded: unload from the engine, release and unpin the cache entry."""
        if loaded:
            try:
                await asyncio.shield(unload_from(self.engine, entry.spec.name, entry.spec.version))
            except Exception:  # noqa: BLE001 - already failing; the entry shows the first error
                log.exception("could not unload %s after a failed load", entry.key)
        self._let_go(entry)

    def _let_go(self, entry: Entry) -> None:
        """Unpin and release the host-cache entry ``entry`` holds; a pull still running gives its own back."""
        with entry.hold_lock:
            digest, entry.cache_digest, entry.let_go = entry.cache_digest, None, True
        if digest is not None:
            self._pin_cache(digest, False)
            self._release(digest)

    def _phase(self, entry: Entry, phase: str, seconds: float) -> None:
        entry.timings[phase] = round(seconds, 6)
        self.metrics.observe_phase(phase, seconds)

    # --- alias, pin, DELETE -------------------------------------------------------------------------------
    def usable(self, name: str, version: str) -> AdapterInfo | None:
        key = adapter_key(name, version)
        return next((a for a in self.engine.adapters(name) if a.key == key), None)

    async def set_pin(self, name: str, version: str, pinned: bool) -> AdapterInfo:
        info = await self.engine.pin_adapter(name, version, pinned)
        entry = self.entries.get(adapter_key(name, version))
        if entry is not None:
            entry.spec = LoadSpec(**{**_fields(entry.spec), "pin": pinned})
            if entry.cache_digest:
                self._pin_cache(entry.cache_digest, pinned)
        return info

    async def unload(self, name: str, version: str | None) -> list[str]:
        """Unload one version or all; in-progress loads of them are cancelled. Returns what went."""
        gone = []
        for key, entry in list(self.entries.items()):
            if entry.spec.name == name and version in (None, entry.spec.version):
                if entry.task is not None and not entry.task.done():
                    entry.task.cancel()
                    await asyncio.wait({entry.task})
                del self.entries[key]
                gone.append(key)
                self._let_go(entry)
        unloaded = await unload_from(self.engine, name, version)
        self.metrics.unloads.inc(len(unloaded))
        return sorted(set(gone) | set(unloaded))


async def unload_from(engine, name: str, version: str | None) -> list[str]:
    """The engine's unload, with "nothing of that name" as an empty answer."""
    try:
        return await engine.unload_adapter(name, version)
    except AdapterError as exc:
        if exc.reason == "AdapterNotFound":
            return []
        raise


def _tell(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run ``fn(*args)`` on the registry's event loop (from a loader thread); dropped once it has closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _fields(spec: LoadSpec) -> dict:
    return {name: getattr(spec, name) for name in spec.__slots__}
