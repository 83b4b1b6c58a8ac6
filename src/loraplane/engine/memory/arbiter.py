"""The GPU memory arbiter: the one object that owns the KV blocks' budget and hands it out (torch-free).

The block manager takes its KV blocks from the arbiter a chunk at a time, asks it for room before the
scheduler preempts anyone, and tells it how much room queued sequences will need; the engine reports its
``stats``. Two arbiters exist, built in one place (``memory/layout.py``) from ``EngineConfig.memory_mode``:

- ``SplitMemory`` ("split"): KV's share is fixed, one chunk of every block, handed over whole at the first
  allocation; the adapters have pools of their own beside it, so it has nothing to trade and no stats.
- ``UnifiedMemory`` ("unified", allocator.py): KV blocks and adapter rows share one arena per layer, and
  chunks change hands between them at run time.

Each side joins the arbiter by one call: the block manager by ``attach_kv`` (what chunks it could give back),
the adapter side by ``attach_adapters`` (how to evict idle adapters when KV needs room).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

FREE = 0  # a chunk's kind: nobody's
KV = -1  # a chunk's kind: the block manager's (a positive kind is a row width: adapter rows)

AdapterReclaimer = Callable[[int, frozenset], None]  # (FREE chunks wanted, adapter keys to spare)


class KVSide(Protocol):
    """What the arbiter asks of the block manager."""

    def idle_kv_chunks(self) -> int:
        """KV chunks none of whose blocks is held (they could go back)."""
        ...

    def release_idle_kv_chunks(self, count: int) -> int:
        """Give up to ``count`` idle KV chunks back to the arbiter (their cached prefixes are lost)."""
        ...


class GpuMemory(Protocol):
    """The arbiter's surface as the block manager and the engine see it."""

    num_blocks: int  # KV blocks in all, whoever holds them now
    num_chunks: int
    chunk_blocks: int  # KV blocks per chunk
    kind: list[int]  # per chunk: FREE, KV or a row width
    # Whether adapter loads may take KV's room: then the scheduler tells it each step (kv_reserve_chunks)
    # how many chunks loads must leave to the queued sequences (False: KV's share is its own).
    reserves_kv: bool
    kv_reserve_chunks: int

    @property
    def num_free_chunks(self) -> int: ...

    def blocks_of(self, chunk: int) -> range: ...

    def attach_kv(self, kv: KVSide) -> None: ...

    def take_kv_chunk(self) -> range | None:
        """A FREE chunk becomes KV; its block ids (None when no chunk is FREE)."""
        ...

    def give_kv_chunk(self, chunk: int) -> None: ...

    def reclaim_for_kv(self, num_chunks: int, keep: frozenset = frozenset()) -> None:
        """KV needs ``num_chunks`` FREE chunks: have the adapter side evict idle adapters (none in ``keep``)."""
        ...

    def stats(self, kv_used_blocks: int | None = None) -> dict[str, float] | None:
        """Chunks and bytes by use (None when nothing is traded: the split)."""
        ...


class SplitMemory:
    """The trivial arbiter of ``memory_mode="split"``: all ``num_blocks`` blocks are KV's, as one chunk."""

    reserves_kv = False  # nothing competes with KV for its share

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = self.chunk_blocks = num_blocks
        self.num_chunks = 1
        self.kind = [FREE]
        self.kv_reserve_chunks = 0

    @property
    def num_free_chunks(self) -> int:
        return 1 if self.kind[0] == FREE else 0

    def blocks_of(self, chunk: int) -> range:
        return range(chunk * self.chunk_blocks, (chunk + 1) * self.chunk_blocks)

    def attach_kv(self, kv: KVSide) -> None:
        """Nobody else wants KV's chunk back: the block manager is never asked."""

    def attach_adapters(self, reclaim: AdapterReclaimer) -> None:
        """The adapters' pools are their own: KV never asks them for room."""

    def take_kv_chunk(self) -> range | None:
        if self.kind[0] != FREE:
            return None
        self.kind[0] = KV
        return self.blocks_of(0)

    def give_kv_chunk(self, chunk: int) -> None:
        raise ValueError(f"chunk {chunk}: the split never takes KV's share back")

    def reclaim_for_kv(self, num_chunks: int, keep: frozenset = frozenset()) -> None:
        """KV's share is all it will ever have."""

    def stats(self, kv_used_blocks: int | None = None) -> None:
        return None
