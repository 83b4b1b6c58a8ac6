"""Adapter pools and the KV cache in one arena per layer, traded at run time through ``UnifiedMemory``.

Per layer one tensor ``arena`` [2, num_blocks, block_size, kv_heads, head_dim]: ``arena[0]`` is the K cache and
``arena[1]`` the V cache (contiguous: attention is unchanged). Each PEFT module m with fan-in i and fan-out o
stores a rank-row as one row of width w = i + o of the flat arena: A's row in its first i elements, B^T's
row in the last o. So one row id addresses both factors, ``LoRAPool``'s single page table serves the shrink
and the expand kernels as it is, and the pools' ``a``/``bt`` are strided views over the arenas:

    rows = arena.view(-1)[: R * w].view(R, w)      # R = arena elements // w
    a[(layer, m)]  = rows[:, :i].unsqueeze(0)      # [1, R, i]
    bt[(layer, m)] = rows[:, i:]                   # [R, o]

Modules of the same width (q and o; k and v; gate, up and down on Llama) share one row space; the pools take
rows from ``UnifiedMemory`` instead of owning pages, and ``UnifiedGpuTier`` decides what fits and what to
evict across widths.
"""

from __future__ import annotations

import torch

from loraplane.engine.lora.layers import PAGE_RANK
from loraplane.engine.lora.tiers import GpuTier
from loraplane.engine.lora.weights import TARGET_MODULES, AdapterWeights, module_shapes
from loraplane.engine.memory.allocator import UnifiedMemory
from loraplane.engine.model.model_config import ModelConfig
from loraplane.kernels import LoRAPool, ModuleSpec, PoolFullError

MAX_ADAPTERS = 4096  # adapter slots per pool (the page table's rows)
MIN_ROWS_PER_SPAN = 8  # a chunk holds at least this many rows of the widest module in each of its spans


def chunk_blocks_for(cfg: ModelConfig, block_size: int) -> int:
    """KV blocks per chunk: the smallest power of two whose span holds MIN_ROWS_PER_SPAN widest rows."""
    block_elems = block_size * cfg.num_kv_heads * cfg.head_dim
    widest = max(i + o for i, o in module_shapes(cfg).values())
    blocks = 1
    while blocks * block_elems < MIN_ROWS_PER_SPAN * widest:
        blocks *= 2
    return blocks


class ArenaPool(LoRAPool):
    """A one-module pool whose rows are views over the arenas and come from the unified memory."""

    zero_a = True  # its rows held KV or another module's adapter: a zeroed row is zeroed in A too

    def __init__(self, module: str, spec: ModuleSpec, arenas: list[torch.Tensor], memory: UnifiedMemory,
                 max_rank: int) -> None:  # fmt: skip
        width = spec.in_dim + spec.out_total
        rows = arenas[0].numel() // width
        a, bt = {}, {}
        for layer, arena in enumerate(arenas):
            view = arena.view(-1)[: rows * width].view(rows, width)
            a[(layer, module)] = view[:, : spec.in_dim].unsqueeze(0)  # [1, R, in]
            bt[(layer, module)] = view[:, spec.in_dim :]  # [R, out]
        super().__init__({module: spec}, len(arenas), 0, page_rank=PAGE_RANK, max_rank=max_rank,
                         max_adapters=min(rows, MAX_ADAPTERS), dtype=arenas[0].dtype,
                         device=arenas[0].device, buffers=(a, bt))  # fmt: skip
        self._free_pages = []  # rows are the memory's, not this pool's
        self.memory, self.width, self.module = memory, width, module

    @property
    def free_pages(self) -> int:
        return self.memory.available_rows(self.width)

    def can_allocate(self, rank: int) -> bool:
        return bool(self._free_slots) and self.memory.fits({self.width: rank})

    def _take_pages(self, need: int) -> list[int]:
        rows = self.memory.take_rows(self.width, need)
        if rows is None:
            raise PoolFullError(f"{self.module}: {need} rows of width {self.width} are not free")
        return rows

    def _give_pages(self, pages: list[int]) -> None:
        self.memory.give_rows(self.width, pages)


class UnifiedGpuTier(GpuTier):
    """The GPU tier over arena pools: fits and evictions are judged across widths by the memory, and it
    evicts idle adapters when KV asks for chunks (``reclaim``)."""

    def __init__(self, pools: dict[str, ArenaPool], memory: UnifiedMemory, device: torch.device) -> None:
        super().__init__(pools, device)
        self.memory = memory
        self._held: dict[str, dict[tuple[int, int], int]] = {}
        self.evictable = lambda key: (
            True
        )  # the adapter tiers' rule, once they share this tier (share_with_kv)

    def share_with_kv(self, evictable, reclaim_for_kv) -> None:
        """KV may evict the versions ``evictable`` allows, through ``reclaim_for_kv`` (the adapter side's,
        which takes its lock and spares what waiting requests need, then calls ``reclaim``)."""
        self.evictable = evictable
        self.memory.attach_adapters(reclaim_for_kv)

    @property
    def capacity_bytes(self) -> int:
        return self.memory.num_blocks * self.memory.block_bytes  # adapters may grow to the whole arena

    def needs(self, weights: AdapterWeights) -> dict[int, int]:
        out: dict[int, int] = {}
        for m, r in weights.ranks.items():
            out[self.pools[m].width] = out.get(self.pools[m].width, 0) + r
        return out

    def fits(self, weights: AdapterWeights) -> bool:
        return bool(self._free_ids) and self.memory.fits(self.needs(weights))

    def _chunks_of(self, key: str) -> dict[tuple[int, int], int]:
        """{(width, chunk): rows} that evicting ``key`` would give back (kept while it stays resident)."""
        held = self._held.get(key)
        if held is None:
            held = {}
            for m, slot in self.slots[key].items():
                width = self.pools[m].width
                for row in self.pools[m].pages_of(slot):
                    u = self.memory.chunk_of_row(width, row)
                    held[(width, u)] = held.get((width, u), 0) + 1
            self._held[key] = held
        return held

    def evict(self, key: str) -> None:
        self._held.pop(key, None)
        super().evict(key)

    def make_room(self, weights: AdapterWeights, evictable, dry_run: bool = False) -> bool:
        """Evict LRU evictable versions until ``weights`` fits; False (nothing evicted) when it cannot.
        ``dry_run``: only say whether it could, evicting nothing."""
        if self.fits(weights):
            return True
        needs, victims, plan = self.needs(weights), [], self.memory.plan()
        for key in self.slots:
            if not evictable(key):
                continue
            victims.append(key)
            for (width, chunk), count in self._chunks_of(key).items():
                plan.release_in(width, chunk, count)
            if plan.fits(needs):
                for victim in victims if not dry_run else ():
                    self.evict(victim)
                return True
        return False

    def reclaim(self, num_free_chunks: int, keep: frozenset) -> None:
        """KV wants ``num_free_chunks`` FREE chunks: evict idle versions, least recently used first."""
        for key in list(self.slots):
            if self.memory.num_free_chunks >= num_free_chunks:
                return
            if key not in keep and self.evictable(key):
                self.evict(key)


def build_unified(cfg: ModelConfig, num_blocks: int, block_size: int, max_rank: int, dtype: torch.dtype,
                  device: torch.device, with_adapters: bool):  # fmt: skip
    """(arenas per layer, memory, arena pools or None); ``num_blocks`` is a multiple of the chunk size."""
    chunk = chunk_blocks_for(cfg, block_size)
    if num_blocks % chunk:
        raise ValueError(f"num_blocks {num_blocks} is not a multiple of the chunk size {chunk}")
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    # One tensor for every layer's arena: each pool's rows are then one strided view across the layers, so
    # an adapter's rows are zeroed or placed in every layer by one kernel (LoRAPool.write_layers).
    arenas = list(torch.zeros((cfg.num_layers, *shape), dtype=dtype, device=device).unbind(0))
    block_elems = block_size * cfg.num_kv_heads * cfg.head_dim
    shapes = module_shapes(cfg)
    widths = [i + o for i, o in shapes.values()] if with_adapters else []
    block_bytes = 2 * cfg.num_layers * block_elems * dtype.itemsize
    memory = UnifiedMemory(num_blocks // chunk, chunk, block_elems, widths, block_bytes)
    if not with_adapters:
        return arenas, memory, None
    pools = {m: ArenaPool(m, ModuleSpec(i, (o,)), arenas, memory, max_rank) for m, (i, o) in shapes.items()}
    assert tuple(pools) == TARGET_MODULES
    return arenas, memory, pools
