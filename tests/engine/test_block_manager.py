"""The paged KV block manager: free list, block tables, refcounts, watermark."""

from __future__ import annotations

import pytest

from loraplane.engine.core.block_manager import BlockManager, NoFreeBlocksError
from loraplane.engine.core.sequence import Sequence


def seq_of(n: int) -> Sequence:
    return Sequence(list(range(n)))


def test_allocate_covers_positions_and_grows_by_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = seq_of(6)
    bm.allocate(seq, 6)
    assert len(seq.block_table) == 2
    assert bm.num_free_blocks == 6
    bm.allocate(seq, 8)  # still inside the second block
    assert len(seq.block_table) == 2
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)


def test_free_returns_blocks_and_clears_table():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq_of(8), seq_of(8)
    bm.allocate(a, 8)
    bm.allocate(b, 8)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(seq_of(1), 1)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(seq_of(1), 1)
    bm.free(a)
    assert a.block_table == []
    assert bm.num_free_blocks == 2
    assert set(b.block_table).isdisjoint(bm._free)


def test_can_append_only_needs_a_block_at_a_boundary():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = seq_of(4)
    bm.allocate(seq, 4)
    seq.num_computed_tokens = 3
    assert bm.can_append(seq)  # position 3 is in block 0
    other = seq_of(4)
    bm.allocate(other, 4)
    seq.num_computed_tokens = 4
    assert not bm.can_append(seq)  # position 4 needs a second block, none free


def test_watermark_only_when_asked():
    bm = BlockManager(num_blocks=100, block_size=1, watermark=0.05)
    assert bm.watermark_blocks == 5
    seq = seq_of(96)
    assert bm.can_allocate(seq, 96)
    assert not bm.can_allocate(seq, 96, keep_watermark=True)
    assert bm.can_allocate(seq, 95, keep_watermark=True)


def test_shared_blocks_are_refcounted():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent, child = seq_of(8), seq_of(8)
    bm.allocate(parent, 8)
    bm.share(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.ref_counts[b] == 2 for b in parent.block_table)
    bm.free(parent)
    assert bm.num_free_blocks == 2  # the child still holds them
    bm.free(child)
    assert bm.num_free_blocks == 4
    assert bm.ref_counts == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="already owns"):
        bm.allocate(parent, 4)
        bm.share(child, parent)


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = seq_of(4)
    bm.allocate(seq, 4)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(seq)


def test_max_tokens_fitting():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = seq_of(10)
    bm.allocate(seq, 6)
    seq.num_computed_tokens = 6
    assert bm.max_tokens_fitting(seq) == 3 * 4 - 6


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_blocks": 0}, "num_blocks"), ({"block_size": 0}, "block_size"), ({"watermark": 1.0}, "watermark")],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BlockManager(**{"num_blocks": 4, "block_size": 4, **kwargs})
