"""The unified memory allocator and the block manager on it (torch-free): chunk geometry, rows and KV blocks
trading chunks both ways, idle KV chunks giving back their cached prefixes, and KV asking the adapter side."""

from __future__ import annotations

import pytest

from loraplane.engine.core.block_manager import BlockManager, NoFreeBlocksError
from loraplane.engine.core.sequence import Sequence
from loraplane.engine.memory.allocator import FREE, KV, UnifiedMemory

WIDTHS = (96, 128, 192)


def memory(num_chunks=6, chunk_blocks=4, block_elems=512) -> UnifiedMemory:
    return UnifiedMemory(num_chunks, chunk_blocks, block_elems, WIDTHS, block_bytes=2 * block_elems * 4)


def test_rows_lie_inside_their_chunk_and_never_overlap():
    mem = memory()
    for width in WIDTHS:
        seen: dict[int, int] = {}
        for chunk in range(mem.num_chunks):
            rows = mem.rows_in(chunk, width)
            assert len(rows) >= 2 * (mem.span // width) - 2
            for row in rows:
                start, end = row * width, (row + 1) * width
                base = 0 if start < mem.range_elems else mem.range_elems
                lo = base + chunk * mem.span
                assert lo <= start and end <= lo + mem.span  # wholly inside one span of this chunk
                assert mem.chunk_of_row(width, row) == chunk
                assert row not in seen
                seen[row] = chunk


def test_kv_and_rows_take_chunks_from_opposite_ends_and_give_them_back():
    mem = memory()
    assert list(mem.take_kv_chunk()) == [0, 1, 2, 3]
    rows = mem.take_rows(192, 5)
    assert len(set(rows)) == 5 and mem.kind[5] == 192 and mem.num_free_chunks == 4
    more = mem.take_rows(192, 3)  # the same chunk serves rows of its width first
    assert mem.num_free_chunks == 4 and not set(rows) & set(more)
    mem.give_rows(192, rows)
    assert mem.kind[5] == 192  # still holds live rows: stays typed (row fragmentation)
    assert 0 < mem.stats()["row_fragmentation"] < 1
    mem.give_rows(192, more)
    assert mem.kind[5] == FREE and mem.num_free_chunks == 5
    mem.give_kv_chunk(0)
    assert mem.num_free_chunks == 6 and mem.kind[0] == FREE
    with pytest.raises(ValueError, match="not a KV chunk"):
        mem.give_kv_chunk(0)


def test_take_rows_is_all_or_nothing():
    mem = memory(num_chunks=2)
    assert mem.take_rows(192, 10_000) is None
    assert mem.num_free_chunks == 2 and all(k == FREE for k in mem.kind)
    assert not mem.fits({192: 10_000}) and mem.fits({192: 4, 96: 4})


def test_fits_counts_rows_that_evictions_would_release():
    mem = memory(num_chunks=2)
    first = mem.take_rows(128, mem.available_rows(128) // 2 + 1)  # takes both chunks
    assert mem.num_free_chunks == 0 and not mem.fits({96: 1})
    assert mem.fits({96: 1}, released={128: first})
    assert mem.fits({128: 1}, released={128: first[:1]})


def test_block_manager_grows_by_chunks_and_gives_idle_chunks_back():
    mem = memory()
    bm = BlockManager(mem.num_blocks, 4, enable_prefix_caching=True, memory=mem)
    assert bm.num_free_blocks == 24  # every chunk FREE: reachable on demand
    seq = Sequence(list(range(20)))
    bm.allocate(seq, 20)  # 5 blocks: two chunks become KV
    assert [mem.kind[u] for u in range(6)] == [KV, KV, FREE, FREE, FREE, FREE]
    assert set(seq.block_table) <= set(range(8))
    seq.num_computed_tokens = 20
    bm.cache_full_blocks(seq)
    assert bm.num_cached_blocks == 5
    assert mem.kv_idle() == 0  # held blocks: not reclaimable
    assert mem.take_rows(192, mem.available_rows(192)) is not None  # the other 4 chunks go to adapters
    assert mem.take_rows(96, 1) is None  # nothing idle yet
    bm.free(seq)
    assert mem.kv_idle() == 2 and bm.num_free_blocks == 8
    assert len(bm.lookup(Sequence(list(range(24))))) == 5  # the whole prefix is cached
    rows = mem.take_rows(96, 1)  # an idle KV chunk goes to adapters, its cached prefix with it
    assert rows is not None and mem.kind.count(KV) == 1 and bm.num_cached_blocks < 5
    assert len(bm.lookup(Sequence(list(range(24))))) == 4  # chunk 1 (block 4) went first: highest idle
    for block_id in mem.blocks_of(mem.chunk_of_row(96, rows[0])):
        assert bm._hash_of[block_id] is None and block_id not in bm._free


def test_block_manager_asks_the_adapter_side_before_giving_up():
    mem = memory(num_chunks=3)
    bm = BlockManager(mem.num_blocks, 4, memory=mem)
    held = mem.take_rows(192, mem.available_rows(192))  # adapters hold everything
    calls = []

    def reclaimer(num_free_chunks, keep):
        calls.append((num_free_chunks, keep))
        mem.give_rows(192, held)

    mem.adapter_reclaimer = reclaimer
    seq = Sequence(list(range(10)))
    assert bm.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(seq, 10)
    assert bm.make_room(3, keep=frozenset({"x@v1"}))
    assert calls == [(1, frozenset({"x@v1"}))]
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and mem.kind.count(KV) == 1


def test_num_blocks_must_match_the_memory():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(7, 4, memory=memory())


def test_loads_leave_the_kv_reserve_alone():
    mem = memory(num_chunks=4)
    bm = BlockManager(mem.num_blocks, 4, memory=mem)
    seq = Sequence(list(range(8)))
    bm.allocate(seq, 8)  # chunk 0 is KV with 2 of its 4 blocks free
    bm.reserve_for_kv(2)  # covered by chunk 0's free blocks: no whole chunk kept back
    assert mem.kv_reserve_chunks == 0 and mem.fits({192: mem._min_rows[192] * 3})
    bm.reserve_for_kv(2 + 5)  # 5 more blocks: two chunks kept back
    assert mem.kv_reserve_chunks == 2
    assert mem.fits({192: mem._min_rows[192]}) and not mem.fits({192: mem._min_rows[192] + 1})
    assert mem.fits({192: 0})  # nothing to take: fits whatever the reserve
