"""Paged KV-cache bookkeeping: block tables, refcounts and automatic prefix caching (torch-free).

The KV cache itself lives in the model runner as [num_blocks, block_size, ...] tensors; this module only decides
which block ids a sequence owns. With prefix caching, every full block that has been computed is registered
under a hash of (its parent block's hash, the sequence's cache salt, its token ids): the salt is the adapter's
identity (its manifest digest, "" for the base), because an adapter changes the keys and values themselves.
A later sequence whose leading blocks hash the same shares them (refcounted) instead of recomputing them.
A block nobody holds goes back to the free list but keeps its content and hash until it is reused: free
blocks are taken least recently freed first, empty ones before cached ones.

The blocks come from the GPU memory arbiter (memory/arbiter.py), a chunk of blocks at a time when the free
list runs dry. The split's arbiter hands over every block as one chunk at the first allocation and never asks
for it back. A unified memory's chunks change hands: the block manager gives back (when asked) chunks none of
whose blocks it holds, dropping their cached prefixes, and ``make_room`` asks the adapter side to evict idle
adapters before the scheduler preempts anyone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from loraplane.engine.core.sequence import Sequence
from loraplane.engine.memory.arbiter import KV, GpuMemory, SplitMemory


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when the caller did not check can_allocate() first."""


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, watermark: float = 0.01, enable_prefix_caching: bool = False,
        memory: GpuMemory | None = None,
    ) -> None:  # fmt: skip
        """``memory``: the arbiter the blocks come from (None: a split of ``num_blocks`` blocks)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark: must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Kept free when admitting new sequences so running ones can still grow by a block without preempting.
        self.watermark_blocks = int(watermark * num_blocks)
        memory = memory if memory is not None else SplitMemory(num_blocks)
        if memory.num_blocks != num_blocks:
            raise ValueError(f"num_blocks: {num_blocks} differs from the memory's {memory.num_blocks}")
        self.memory = memory
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = (
            OrderedDict()
        )  # the blocks of its KV chunks; taken from the front
        self._chunk_used = [0] * memory.num_chunks  # held blocks per chunk
        memory.attach_kv(self)
        self._hash_of: list[bytes | None] = [None] * num_blocks  # the content a block holds, if registered
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_queried_tokens = 0  # prompt tokens looked up at admission
        self.prefix_hit_tokens = 0  # of those, found in the cache

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks, plus those of the memory's FREE chunks (KV takes them on demand)."""
        return len(self._free) + self.memory.num_free_chunks * self.memory.chunk_blocks

    @property
    def num_used_blocks(self) -> int:
        return sum(1 for count in self.ref_counts if count)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that seq.block_table covers positions [0, num_tokens)."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, keep_watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks - reserve

    def can_append(self, seq: Sequence) -> bool:
        """Whether seq can compute its next position (a decode step) without a new block being unavailable."""
        return self.can_allocate(seq, seq.num_computed_tokens + 1)

    def max_tokens_fitting(self, seq: Sequence) -> int:
        """How many positions past seq.num_computed_tokens fit in its own blocks plus every free block."""
        slots = (len(seq.block_table) + self.num_free_blocks) * self.block_size
        return max(0, slots - seq.num_computed_tokens)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq.block_table until it covers positions [0, num_tokens)."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"seq {seq.seq_id} needs {missing} blocks for {num_tokens} tokens, {self.num_free_blocks} free"
            )
        for _ in range(missing):
            if not self._free:
                self._grow()
            block_id, _ = self._free.popitem(last=False)
            self._forget(block_id)  # its old content is overwritten from now on
            self.ref_counts[block_id] = 1
            self._held(block_id, 1)
            seq.block_table.append(block_id)

    def share(self, src: Sequence, dst: Sequence) -> None:
        """Make dst own src's blocks too (refcounted); dst must have no blocks yet."""
        if dst.block_table:
            raise ValueError(f"seq {dst.seq_id} already owns blocks")
        for block_id in src.block_table:
            self.ref_counts[block_id] += 1
        dst.block_table = list(src.block_table)

    def free(self, seq: Sequence) -> None:
        """Drop seq's claim on all its blocks; blocks nobody else holds go back to the free list."""
        for block_id in reversed(seq.block_table):  # its tail blocks are reused before its head blocks
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated (seq {seq.seq_id})")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._held(block_id, -1)
                self._free[block_id] = None
                if self._hash_of[block_id] is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_cached_blocks = 0

    # --- the memory arbiter ---------------------------------------------------------------------------------
    def make_room(self, num_blocks: int, keep: frozenset = frozenset()) -> bool:
        """Whether ``num_blocks`` blocks are free, after asking the adapter side of a unified memory to evict
        idle adapters (none in ``keep``: the adapters of queued and running requests) when they are not."""
        short = num_blocks - self.num_free_blocks
        if short > 0:
            chunks = -(-short // self.memory.chunk_blocks)
            self.memory.reclaim_for_kv(self.memory.num_free_chunks + chunks, keep)
        return num_blocks <= self.num_free_blocks

    def reserve_for_kv(self, num_blocks: int) -> None:
        """Keep room for ``num_blocks`` more blocks out of adapter loads' reach (a unified memory's
        ``kv_reserve_chunks``): free blocks of KV chunks in use count first, then whole chunks."""
        c = self.memory.chunk_blocks
        in_use = len(self._free) - self.idle_kv_chunks() * c  # free blocks of chunks holding others
        self.memory.kv_reserve_chunks = -(-max(0, num_blocks - in_use) // c)

    def _held(self, block_id: int, delta: int) -> None:
        self._chunk_used[block_id // self.memory.chunk_blocks] += delta

    def _grow(self) -> None:
        blocks = self.memory.take_kv_chunk()
        if blocks is None:
            raise NoFreeBlocksError("no free KV block and no free chunk")
        for block_id in reversed(blocks):  # empty: taken first, lowest id first
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def _idle_chunks(self) -> list[int]:
        memory = self.memory
        return [u for u, used in enumerate(self._chunk_used) if not used and memory.kind[u] == KV]

    def idle_kv_chunks(self) -> int:
        """KV chunks none of whose blocks is held (the arbiter may ask for them back)."""
        return len(self._idle_chunks())

    def release_idle_kv_chunks(self, count: int) -> int:
        """Give up to ``count`` KV chunks nobody holds a block of back to the memory (their cache is lost)."""
        released = self._idle_chunks()[::-1][:count]  # highest first: KV grows from the low end
        for chunk in released:
            for block_id in self.memory.blocks_of(chunk):
                del self._free[block_id]
                self._forget(block_id)
            self.memory.give_kv_chunk(chunk)
        return len(released)

    # --- prefix caching -------------------------------------------------------------------------------------
    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading full blocks; the last token is always left to compute."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        hits: list[int] = []
        for index in range((seq.num_tokens - 1) // self.block_size):
            block_id = self._cached.get(self._block_hash(seq, index))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_admit(self, seq: Sequence, hits: list[int], num_tokens: int, keep_watermark: bool) -> bool:
        """Whether seq, starting on its cached `hits`, can cover positions [0, num_tokens)."""
        return self.blocks_to_admit(hits, num_tokens, keep_watermark) <= self.num_free_blocks

    def blocks_to_admit(self, hits: list[int], num_tokens: int, keep_watermark: bool) -> int:
        """Free blocks that admitting a sequence on its cached ``hits`` to cover [0, num_tokens) needs."""
        reserve = self.watermark_blocks if keep_watermark else 0
        revived = sum(1 for block_id in hits if self.ref_counts[block_id] == 0)  # taken off the free list
        missing = max(0, self.blocks_for(num_tokens) - len(hits))
        return missing + revived + reserve

    def claim(self, seq: Sequence, hits: list[int]) -> None:
        """Start seq's block table with the cached blocks `hits` (from lookup())."""
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
                self._held(block_id, 1)
            self.ref_counts[block_id] += 1
        seq.block_table = list(hits)
        seq.num_cached_blocks = len(hits)
        if self.enable_prefix_caching:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(hits) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that seq has filled and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for index in range(seq.num_cached_blocks, full):
            block_id, block_hash = seq.block_table[index], self._block_hash(seq, index)
            if self._hash_of[block_id] is None and block_hash not in self._cached:
                self._cached[block_hash] = block_id
                self._hash_of[block_id] = block_hash
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def _block_hash(self, seq: Sequence, index: int) -> bytes:
        """hash(parent block hash, cache salt, token ids of block `index`), memoised on seq."""
        hashes, size = seq.block_hashes, self.block_size
        salt = seq.cache_salt.encode()
        while len(hashes) <= index:
            start = len(hashes) * size
            digest = hashlib.sha256(hashes[-1] if hashes else b"\0" * 32)
            digest.update(len(salt).to_bytes(4, "little") + salt)
            digest.update(array("q", seq.token_ids[start : start + size]).tobytes())
            hashes.append(digest.digest())
        return hashes[index]

    def _forget(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash_of[block_id] = None
