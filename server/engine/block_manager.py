"""Paged KV-cache bookkeeping: a free list, per-sequence block tables and per-block refcounts (torch-free).

The KV cache itself lives in the model runner as [num_blocks, block_size, ...] tensors; this module only decides
which block ids a sequence owns. Refcounts let a block be shared (prefix reuse keyed by adapter version and
token hash is a later issue): a block returns to the free list when its last owner lets go.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when the caller did not check can_allocate() first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark: must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Kept free when admitting new sequences so running ones can still grow by a block without preempting.
        self.watermark_blocks = int(watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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
            block_id = self._free.popleft()
            self.ref_counts[block_id] = 1
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
        for block_id in reversed(seq.block_table):
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated (seq {seq.seq_id})")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)
        seq.block_table = []
