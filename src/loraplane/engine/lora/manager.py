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

from loraplane.engine.api import AdapterError, AdapterInfo, RemoteAdapter, adapter_key
from loraplane.engine.lora.load_queue import LoadQueue
from loraplane.engine.lora.loader import AdapterLoader
from loraplane.engine.lora.pinned import PinnedArena, take_or_evict
from loraplane.engine.lora.remote import checked_ranks
from loraplane.engine.lora.safetensors_io import Reader, read_file
from loraplane.engine.lora.tier_moves import TierMoves
from loraplane.engine.lora.tiers import GpuTier, HostTier
from loraplane.engine.lora.version import AdapterVersion, known_sha256
from loraplane.engine.lora.weights import AdapterWeights, header_ranks, load_adapter_weights
from loraplane.engine.model.model_config import ModelConfig
from loraplane.kernels import LoRABatchMeta, LoRAPool

ARENA_WAIT_S = 0.5  # how long a parse waits for copies in flight to give arena blocks back


class AdapterTiers(TierMoves):
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

    # -- registry (any thread) --------------------------------------------------------------------------
    def register(self, name: str, version: str, folder: Path, digest: str, weights: AdapterWeights | None, *,
                 pin: bool = False, load_s: float = 0.0) -> AdapterInfo:  # fmt: skip
        key = adapter_key(name, version)
        sha256 = (
            weights.digest() if weights is not None else None
        )  # before the lock: it may wait for the hash
        with self.lock:
            old = self.versions.get(key)
            if old is not None and old.digest != digest:
                raise AdapterError(
                    "AdapterConflict", f"{key}: already loaded with digest {old.digest}, not {digest}"
                )
            if old is not None:
                old.unloading = False
                self.unloading.discard(key)
                old.pinned = old.pinned or pin
                return self.info(key)
            if weights is None:
                raise AdapterError("AdapterNotFound", f"adapter {key!r} is not loaded")
            for m, r in weights.ranks.items():
                if r > self.gpu.pools[m].num_pages:
                    raise AdapterError("RankTooHigh", f"{key}: {m} rank {r} exceeds the adapter pool")
            v = AdapterVersion(
                name, version, digest, Path(folder), weights.rank, self.gpu.bytes_for(weights), pin
            )
            v.timings["load"] = load_s
            v.sha256, v.ranks = sha256, dict(weights.ranks)
            self.versions[key] = v
            self.host.put(key, weights, self._host_evictable)
            return self.info(key)

    def register_on_disk(self, name: str, version: str, folder: Path, digest: str, *,
                         pin: bool = False) -> AdapterInfo:  # fmt: skip
        """Register a version whose weights stay in ``folder`` until a request needs them (only the config
        and the weights file's header are read now; the full checks run when it loads)."""
        ranks = header_ranks(folder, self.model_config, max_rank=self.max_rank)
        return self._register_shape(name, version, Path(folder), digest, ranks, pin)

    def register_remote(self, name: str, version: str, digest: str, remote: RemoteAdapter, *,
                        pin: bool = False) -> AdapterInfo:  # fmt: skip
        """Register a version whose files are not on this node: ``remote.fetch`` brings them on a loader
        worker when a request or a warm-up first needs it (the usual parse and checks follow)."""
        key = adapter_key(name, version)
        ranks = checked_ranks(key, remote, self.max_rank, self.gpu.pools)
        return self._register_shape(name, version, None, digest, ranks, pin, remote)

    def _register_shape(self, name: str, version: str, folder: Path | None, digest: str,
                        ranks: dict[str, int], pin: bool, remote: RemoteAdapter | None = None) -> AdapterInfo:  # fmt: skip
        """A version known by its ranks alone (no weights parsed yet)."""
        key = adapter_key(name, version)
        with self.lock:
            if key in self.versions:
                return self.register(name, version, folder, digest, None, pin=pin)
            for m, r in ranks.items():
                if r > self.gpu.pools[m].num_pages:
                    raise AdapterError("RankTooHigh", f"{key}: {m} rank {r} exceeds the adapter pool")
            shape = AdapterWeights(a={}, b={}, ranks=ranks)
            v = AdapterVersion(name, version, digest, folder, shape.rank, self.gpu.bytes_for(shape), pin)
            v.ranks, v.remote = ranks, remote
            self.versions[key] = v
            return self.info(key)

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
        """``key`` can never serve (its warm-up forward failed): its requests fail, ``info`` shows why."""
        with self.lock:
            v = self.versions[key]
            v.state, v.error = "failed", f"{error.reason}: {error}"

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
                raise AdapterError(v.error_reason or "BadAdapterFile", f"adapter {key!r}: {v.error}")

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
                self.ensure_resident(keys)
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
