"""Where an adapter version's weights live: GPU pool pages, pinned host RAM, or only its folder on disk.

- ``HostTier``: an LRU of parsed ``AdapterWeights`` within a byte limit (page-locked on CUDA, so copies
  to the GPU can be asynchronous). Dropping an entry leaves the adapter on disk, from where it is parsed
  again when needed.
- ``GpuTier``: each version's slots in the per-module pools. ``start_copy`` allocates the pages and copies
  the factors from host memory on a side CUDA stream (plain copies on CPU); ``done`` says when the copy has
  landed. ``make_room`` evicts least-recently-used versions that nothing holds.

Neither tier decides what may be evicted: the caller passes ``evictable(key)`` (not pinned, not held by a
running or queued request, not in the step being built).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from loraplane.engine.lora.weights import AdapterWeights
from loraplane.kernels import LoRAPool


class HostTier:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.entries: OrderedDict[str, AdapterWeights] = OrderedDict()  # least recently used first

    @property
    def bytes(self) -> int:
        return sum(w.nbytes for w in self.entries.values())

    def get(self, key: str) -> AdapterWeights | None:
        w = self.entries.get(key)
        if w is not None:
            self.entries.move_to_end(key)
        return w

    def put(self, key: str, weights: AdapterWeights, evictable: Callable[[str], bool]) -> list[str]:
        """Insert, then drop LRU entries (never ``key``) until within the limit; returns the dropped keys."""
        self.entries[key] = weights
        self.entries.move_to_end(key)
        dropped, total = [], self.bytes
        for other in list(self.entries):
            if total <= self.limit_bytes:
                break
            if other != key and evictable(other):
                total -= self.entries.pop(other).nbytes
                dropped.append(other)
        return dropped

    def drop(self, key: str) -> None:
        self.entries.pop(key, None)


class GpuTier:
    def __init__(self, pools: dict[str, LoRAPool], device: torch.device) -> None:
        self.pools = pools
        self.device = device
        self.slots: OrderedDict[str, dict[str, int]] = OrderedDict()  # key -> module -> slot; LRU first
        self.bytes_of: dict[str, int] = {}
        # One slot numbering across the pools: a version has the same slot in every module it targets and
        # rank 0 (no work) in the others, so one batch metadata serves every module of a step.
        self.num_slots = min(p.max_adapters for p in pools.values())
        self._free_ids = list(range(self.num_slots - 1, -1, -1))
        self.slot_id: dict[str, int] = {}
        self.ranks = [0] * self.num_slots  # largest rank over modules per slot (the metadata builder's view)
        self._pending: dict[str, tuple[torch.cuda.Event, AdapterWeights, float]] = {}  # copies in flight
        self.copy_s: dict[str, float] = {}  # key -> seconds from issue until its copy was seen landed
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # TP hook: rank 0 repeats every copy and eviction on the workers (parallel/lora_sync.py)
        self.mirror = None

    def share_with_kv(self, evictable: Callable[[str], bool], reclaim_for_kv: Callable) -> None:
        """Pools of its own share nothing with KV (the unified memory's tier overrides this)."""

    # -- accounting ---------------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return sum(p.capacity_bytes for p in self.pools.values())

    @property
    def bytes(self) -> int:
        return sum(self.bytes_of.values())

    def fits(self, weights: AdapterWeights) -> bool:
        return bool(self._free_ids) and all(
            self.pools[m].pages_for_rank(r) <= self.pools[m].free_pages for m, r in weights.ranks.items()
        )

    def bytes_for(self, weights: AdapterWeights) -> int:
        return sum(self.pools[m].bytes_for_rank(r) for m, r in weights.ranks.items())

    def holds(self, key: str) -> bool:
        return key in self.slots

    def done(self, key: str) -> bool:
        """Resident and its copy has landed (the next step may read it)."""
        if key not in self.slots:
            return False
        pending = self._pending.get(key)
        if pending is not None:
            if not pending[0].query():
                return False
            del self._pending[key]
            self.copy_s[key] = time.perf_counter() - pending[2]
        return True

    def copies_in_flight(self) -> bool:
        return bool(self._pending)

    def touch(self, key: str) -> None:
        self.slots.move_to_end(key)

    # -- moves --------------------------------------------------------------------------------------------
    def make_room(
        self, weights: AdapterWeights, evictable: Callable[[str], bool], dry_run: bool = False
    ) -> bool:
        """Evict LRU evictable versions until ``weights`` fits; False (nothing evicted) when it cannot.
        ``dry_run``: only say whether it could, evicting nothing."""
        if self.fits(weights):
            return True
        victims, freed = [], {m: 0 for m in self.pools}
        for key in self.slots:
            if not evictable(key):
                continue
            victims.append(key)
            for m, slot in self.slots[key].items():
                freed[m] += self.pools[m].rank_of(slot)
            if all(self._fits_after(m, r, freed[m]) for m, r in weights.ranks.items()):
                for victim in victims if not dry_run else ():
                    self.evict(victim)
                return True
        return False

    def _fits_after(self, module: str, rank: int, freed_rows: int) -> bool:
        pool = self.pools[module]
        return pool.free_pages + freed_rows >= pool.pages_for_rank(rank)  # (a victim frees a slot too)

    def start_copy(self, key: str, weights: AdapterWeights) -> None:
        """Allocate the version's pages in every module it has and copy its factors in (async on CUDA)."""
        start = time.perf_counter()
        gid = self._free_ids.pop()
        # No zeroing: _write fills every row of every layer (B of layers below r_m holds zeros). A module
        # without a scale of its own has it folded into B.
        slots = {
            m: self.pools[m].allocate(r, weights.scales.get(m, 1.0), slot=gid, zero=False)
            for m, r in weights.ranks.items()
        }
        self.slots[key], self.slot_id[key], self.ranks[gid] = slots, gid, weights.rank
        self.bytes_of[key] = self.bytes_for(weights)
        if self.mirror is not None:  # TP hook: the workers take the same slot; this rank writes its shard
            weights = self.mirror.copy(gid, weights)
        if self._stream is None:
            self._write(slots, weights)
            return
        # The side stream waits for the compute stream (pages just freed may still be read by the last step).
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._write(slots, weights)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending[key] = (event, weights, start)  # keeps the pinned source alive until the copy lands

    def _write(self, slots: dict[str, int], weights: AdapterWeights) -> None:
        """Per module: one host-to-device copy per factor, then every layer's rows placed into the slot's
        pages by one indexed copy per factor (B^T read through a transposed view), wherever the pages are.
        The engine thread's work per load does not grow with the layers or with scattered pages."""
        for m, slot in slots.items():
            a = weights.a[m].to(self.device, non_blocking=True)  # [L, r_m, in]
            bt = weights.b[m].to(self.device, non_blocking=True).transpose(1, 2)  # [L, r_m, out] (a view)
            self.pools[m].write_layers(slot, m, a, bt)

    def wait(self, key: str) -> None:
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending[0].synchronize()

    def wait_all(self) -> None:
        """Every copy still in flight has landed."""
        for key in list(self._pending):
            self.wait(key)

    def evict(self, key: str) -> None:
        self.wait(key)
        if self.mirror is not None:  # TP hook
            self.mirror.evict(self.slot_id[key])
        for m, slot in self.slots.pop(key).items():
            self.pools[m].free(slot)
        gid = self.slot_id.pop(key)
        self.ranks[gid] = 0
        self._free_ids.append(gid)
        self.bytes_of.pop(key, None)
        self.copy_s.pop(key, None)
