"""``AdapterTiers``: the engine's adapter versions, their aliases, where their weights are (GPU, host, disk,
remote), and the scheduler's ``AdapterResidency``.

A version is ``name@version``; its identity is the manifest digest. ``register`` puts a parsed, validated
version in the host tier (``register_on_disk``: only its folder; ``register_remote``: only its manifest,
the files fetched on first need); the scheduler then ``request``s it toward the GPU (remote -> disk pulls
and disk -> host parses on the loader's worker threads, several at once; host -> GPU copies on a side
stream), admits its requests once ``is_ready``, and ``acquire``/``release``s it around each running
sequence. What a running or queued request needs, and what is pinned, is never evicted from either tier.

Threads: the registry (load, alias, pin, the read-only views) may be used from any thread under ``lock``;
everything that touches the device (``poll``, ``prepare_step``, eviction, copies) runs on the engine thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from loraplane.engine.api import AdapterError, AdapterInfo, adapter_key
from loraplane.engine.lora.load_queue import LoadQueue
from loraplane.engine.lora.loader import AdapterLoader
from loraplane.engine.lora.pinned import PinnedArena, take_or_evict
from loraplane.engine.lora.registration import Registrations
from loraplane.engine.lora.remote import public_error
from loraplane.engine.lora.safetensors_io import Reader, read_file
from loraplane.engine.lora.tier_moves import TierMoves
from loraplane.engine.lora.tiers import GpuTier, HostTier
from loraplane.engine.lora.version import AdapterVersion, known_sha256, load_failure
from loraplane.engine.lora.weights import AdapterWeights, load_adapter_weights
from loraplane.engine.model.model_config import ModelConfig
from loraplane.kernels import LoRABatchMeta, LoRAPool

ARENA_WAIT_S = 0.5  # how long a parse waits for copies in flight to give arena blocks back


class AdapterTiers(Registrations, TierMoves):
    def __init__(self, model_config: ModelConfig, pools: dict[str, LoRAPool], *, max_rank: int,
                 host_bytes: int, max_num_batched_tokens: int, max_num_seqs: int,
                 graph_batch_size: int = 0, gpu_tier: GpuTier | None = None,
                 host_arena: bool | None = None) -> None:  # fmt: skip
        """``host_arena``: parsed adapters live in one arena of ``host_bytes`` (default: on CUDA, where it
        is page-locked once instead of once per load)."""
        pool = next(iter(pools.values()))
        self.model_config, self.max_rank = model_config, max_rank
        self.dtype, self.device = pool.dtype, pool.device
        self.lock = threading.RLock()
        self.versions: dict[str, AdapterVersion] = {}
        self.aliases: dict[str, str] = {}  # name -> serving version
        self.host = HostTier(host_bytes)
        cuda = self.device.type == "cuda"
        self.arena = (
            PinnedArena(host_bytes, pin=cuda) if (cuda if host_arena is None else host_arena) else None
        )
        self.gpu = gpu_tier if gpu_tier is not None else GpuTier(pools, self.device)
        self.gpu.share_with_kv(self._gpu_evictable, self._reclaim_for_kv)  # unified memory: KV may evict
        self.wanted = LoadQueue()  # requested toward the GPU and not there yet, first requested first
        self.unloading: set[str] = set()  # marked for unloading, freed by ``poll`` once nothing uses them
        self.step_keys: frozenset[str] = frozenset()
        self.step_modules: frozenset[str] = frozenset()  # modules the last prepared step's adapters have
        self.last_step = (0, 0, 0)  # tokens, sequences, distinct adapters
        self.arena_misses = 0  # parses that found no room in the arena (benchmarks, tests)
        self.read: Reader = read_file  # how weights files are read (tests inject a slow or failing one)
        self.loader = AdapterLoader(self.parse, one_cpu_thread=self.device.type == "cuda")
        self.loader.on_done = self._loaded
        # The serving loop's wake-up: called (on a loader thread) when a load ends, since the engine thread
        # may be blocked because every queued request waits for an adapter.
        self.waker: Callable[[], None] | None = None
        # One metadata per step kind, shared by every module (one slot numbering across the pools).
        self._metas = {
            "decode": LoRABatchMeta(max_num_seqs, self.device, tile_m=16),
            "prefill": LoRABatchMeta(max_num_batched_tokens, self.device, tile_m=64),
        }
        if graph_batch_size:  # fixed buffers read by captured decode graphs
            self._metas["graph"] = LoRABatchMeta(
                graph_batch_size, self.device, capture=True, max_rank=max_rank
            )

    # -- parsing ----------------------------------------------------------------------------------------
    def parse(self, folder: Path, sha256: str | None = None, file_id: tuple | None = None) -> AdapterWeights:
        """Read and validate a PEFT folder into host tensors (page-locked on CUDA). Any thread.
        ``sha256``: what the weights file hashed to when first read (a changed file is refused); ``file_id``:
        its identity then (an unwritten file is not hashed again)."""
        return load_adapter_weights(folder, self.model_config, max_rank=self.max_rank, dtype=self.dtype,
                                    pin=self.device.type == "cuda", read=self.read, sha256=sha256,
                                    alloc=self._host_block if self.arena is not None else None,
                                    file_id=file_id)  # fmt: skip

    def _host_block(self, nbytes: int) -> torch.Tensor:
        """Room for one parse in the host arena (loader threads); pageable memory when there is none (its
        copy to the GPU then blocks the engine thread for the copy's length)."""
        block = take_or_evict(self.arena, nbytes, self._drop_lru_host, ARENA_WAIT_S)
        if block is None:
            self.arena_misses += 1
            block = torch.empty(nbytes, dtype=torch.uint8)
        return block

    def _drop_lru_host(self) -> bool:
        """Drop one host copy nothing needs (loader threads). Never waits for the lock: the engine thread
        may hold it while it waits for this very parse (``ensure_resident``); the arena's wait then runs out
        and the parse takes pageable memory instead of deadlocking."""
        if not self.lock.acquire(timeout=0.005):
            return False
        try:
            victim = next((k for k in self.host.entries if self._host_evictable(k)), None)
            if victim is not None:
                self.host.drop(victim)
            return victim is not None
        finally:
            self.lock.release()

    def _loaded(self) -> None:
        waker = self.waker
        if waker is not None:
            waker()

    def idle_wait_s(self) -> float:
        """How long the serving loop may block when nothing can run: a load's end wakes it, but a
        host-to-device copy landing does not, so while one is in flight it looks again soon."""
        return 0.0005 if self.gpu.copies_in_flight() else 0.05

    # -- registry (any thread; registration: Registrations) ------------------------------------------------
    def prefetch(self, key: str) -> Future | None:
        """Start loading a disk or remote version into the host tier (any thread: it only hands the read or
        the pull to the loader), so a warm-up can wait for it off the engine thread. Its load, or None."""
        with self.lock:
            v = self.get(key)
            if v.loading is None and v.state != "failed" and key not in self.host.entries:
                if not self.gpu.holds(key) and (v.hashing is None or v.hashing.done()):
                    v.loading = self._start_load(key, v)
            return v.loading

    def get(self, key: str) -> AdapterVersion:
        v = self.versions.get(key)
        if v is None or v.unloading:
            raise AdapterError("AdapterNotFound", f"adapter {key!r} is not loaded")
        return v

    def resolve(self, name: str) -> str | None:
        with self.lock:
            version = self.aliases.get(name)
            return None if version is None else adapter_key(name, version)

    def set_alias(self, name: str, version: str) -> None:
        with self.lock:
            self.get(adapter_key(name, version))
            self.aliases[name] = version  # one assignment: a reader sees the old or the new version

    def set_pinned(self, key: str, pinned: bool) -> AdapterInfo:
        with self.lock:
            self.get(key).pinned = pinned
            return self.info(key)

    def mark_unloading(self, name: str, version: str | None) -> list[str]:
        """Stop taking requests for ``name@version`` (every version when None); freed by ``collect``."""
        with self.lock:
            keys = [k for k, v in self.versions.items() if v.name == name and not v.unloading
                    and (version is None or v.version == version)]  # fmt: skip
            if not keys:
                raise AdapterError("AdapterNotFound", f"adapter {name}@{version or '*'} is not loaded")
            for key in keys:
                self.versions[key].unloading = True
                self.unloading.add(key)
                if self.aliases.get(name) == self.versions[key].version:
                    del self.aliases[name]
            return keys

    def hold(self, key: str, leased: bool = False) -> None:
        """Count a request in as it is submitted (any thread), in the same step as the check that ``key`` takes
        requests: from then on an unload waits for it, even while it is still queued for the engine thread.
        ``leased``: the caller holds an AdapterLease on ``key``, so an unloading version still takes it."""
        with self.lock:
            v = self.versions.get(key) if leased else None
            (v or self.get(key)).in_flight += 1

    def note_request(self, key: str, delta: int) -> None:
        """The async engine counts each request from submission (``hold``) to its end (queued or running)."""
        with self.lock:
            v = self.versions.get(key)
            if v is not None:
                v.in_flight += delta

    def is_registered(self, key: str) -> bool:
        """Whether ``key`` is registered, in any state (unloading included)."""
        with self.lock:
            return key in self.versions

    def mark_warm(self, key: str, seconds: float) -> None:
        """A real forward ran through ``key``, in ``seconds``."""
        with self.lock:
            v = self.versions[key]
            v.timings["warm"] = seconds
            v.state, v.error = "warm", None

    def mark_failed(self, key: str, error: AdapterError) -> None:
        """``key`` can never serve (its warm-up failed): its requests fail, ``info`` shows why. A version
        whose load already failed keeps that first failure (the warm-up only found it)."""
        with self.lock:
            v = self.versions[key]
            if v.state != "failed":
                v.state, v.error, v.error_reason = "failed", f"{error.reason}: {error}", error.reason

    def has_room_for(self, key: str) -> bool:
        """Resident already, or it fits the GPU pools without evicting anything."""
        with self.lock:
            v = self.get(key)
            return self.gpu.done(key) or self.gpu.fits(AdapterWeights(a={}, b={}, ranks=v.ranks))

    def tier_of(self, key: str) -> str | None:
        with self.lock:
            if key not in self.versions:
                return None
            if self.gpu.done(key):
                return "gpu"
            if key in self.host.entries:
                return "host"
            return "disk" if self.versions[key].folder is not None else "remote"

    def info(self, key: str) -> AdapterInfo:
        with self.lock:
            v = self.versions[key]
            if v.hashing is not None and v.hashing.done():
                known_sha256(v)
            return AdapterInfo(
                name=v.name, version=v.version, digest=v.digest, state=v.state, tier=self.tier_of(key),
                pinned=v.pinned, serving=self.aliases.get(v.name) == v.version, bytes=v.pool_bytes,
                rank=v.rank, in_flight=v.in_flight, timings=dict(v.timings), error=v.error,
            )  # fmt: skip

    def infos(self, name: str | None = None) -> list[AdapterInfo]:
        """Every version not being unloaded, or only ``name``'s (an admin call about one adapter on a pod
        holding thousands must not describe them all)."""
        with self.lock:
            return [self.info(k) for k, v in self.versions.items()
                    if not v.unloading and name in (None, v.name)]  # fmt: skip

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Bytes and entries per tier (disk: every version with a folder here, which stays its source;
        remote: the versions whose files are not fetched yet)."""
        with self.lock:
            remote = sum(v.folder is None for v in self.versions.values())
            return {
                "gpu": {"bytes": self.gpu.bytes, "entries": len(self.gpu.slots), "capacity": self.gpu.capacity_bytes},
                "host": {"bytes": self.host.bytes, "entries": len(self.host.entries), "capacity": self.host.limit_bytes},
                "disk": {"bytes": 0, "entries": len(self.versions) - remote},
                "remote": {"bytes": 0, "entries": remote},
            }  # fmt: skip

    # -- AdapterResidency (engine thread) ----------------------------------------------------------------
    @property
    def max_adapters_per_step(self) -> int:
        return min(p.max_adapters for p in self.gpu.pools.values())

    def is_ready(self, key: str) -> bool:
        with self.lock:
            # only a requested load moves on here: the scheduler decides which loads may take memory
            return key in self.versions and (
                self.gpu.done(key) or (key in self.wanted and self._advance(key))
            )

    def request(self, key: str) -> None:
        """Start moving ``key`` toward the GPU; AdapterError when it can never get there (unknown, fully
        unloaded, or its folder failed to load), so the requests waiting for it fail instead of waiting."""
        with self.lock:
            v = self.versions.get(key)
            if v is None:
                raise AdapterError("AdapterNotFound", f"adapter {key!r} is not loaded")
            if not self.gpu.done(key):
                self.wanted.add(key)
                self._advance(key)
            if v.state == "failed":
                raise AdapterError(v.error_reason or "BadAdapterFile", f"adapter {key!r}: {public_error(v)}")

    def acquire(self, key: str) -> None:
        with self.lock:
            v = self.versions.get(key)
            if v is not None:
                v.refs += 1

    def release(self, key: str) -> None:
        with self.lock:
            v = self.versions.get(key)
            if v is not None:
                v.refs = max(0, v.refs - 1)

    def digest(self, key: str) -> str:
        v = self.versions.get(key)
        if v is None:
            raise KeyError(key)
        return v.digest

    def _reclaim_for_kv(self, num_free_chunks: int, keep: frozenset) -> None:
        with self.lock:
            self.gpu.reclaim(num_free_chunks, keep | self.wanted.keys())

    # -- one step's metadata (engine thread) -------------------------------------------------------------
    def prepare_step(
        self, chunks: list[tuple[str | None, int]], kind: str
    ) -> dict[str, LoRABatchMeta | None]:
        """Batch metadata per module pool for a step of ``chunks`` [(adapter key or None, tokens)].

        kind: 'decode' | 'prefill' | 'graph'. A module no token uses gets None (no launch), except under a
        captured graph, whose launches are fixed (their tiles are then empty).
        """
        keys = {k for k, _ in chunks if k is not None}
        with self.lock:
            self.step_keys = frozenset(keys)  # making one of them resident must not evict another
            try:
                self.poll()
                self._ensure_resident_or_why(keys)
            finally:
                self.step_keys = frozenset()
            for key in keys:
                self.gpu.touch(key)
            self.last_step = (sum(n for _, n in chunks), len(chunks), len(keys))
            meta = None
            if kind == "graph" or keys:
                reqs = [(self.gpu.slot_id[k] if k is not None else -1, n) for k, n in chunks]
                meta = self._metas[kind].build(reqs, self.gpu.ranks)
            used = {m for k in keys for m in self.gpu.slots[k]}  # modules some token of the step has
            self.step_modules = frozenset(used)
            if kind == "graph":
                return dict.fromkeys(self.gpu.pools, meta)
            return {m: meta if m in used else None for m in self.gpu.pools}

    def _ensure_resident_or_why(self, keys) -> None:
        """``ensure_resident``, whose refusal names a load's own failure (the pull's or the parse's reason)
        rather than only that the version cannot be made resident."""
        try:
            self.ensure_resident(keys)
        except AdapterError as error:
            why = next(filter(None, (load_failure(k, self.versions.get(k)) for k in keys)), None)
            if why is None:
                raise
            raise why from error

    def step_metadata(self) -> dict[str, LoRABatchMeta]:
        """The metadata builder of each step kind ('decode', 'prefill', and 'graph' when decode is captured)."""
        return dict(self._metas)

    def graph_metas(self, modules=None) -> dict[str, LoRABatchMeta | None]:
        """The fixed metadata a decode graph is captured with (no tiles), for ``modules`` (default: every
        module); the others get None, so the graph holds no launch for them."""
        meta = self._metas["graph"].build([], self.gpu.ranks)
        return {m: meta if modules is None or m in modules else None for m in self.gpu.pools}

    def close(self) -> None:
        """Stop the loader and unlock the host arena, once every copy from it has landed (the engine's
        thread has stopped: nothing starts another)."""
        self.loader.close()
        with self.lock:
            self.gpu.wait_all()
        if self.arena is not None:
            self.arena.close()
