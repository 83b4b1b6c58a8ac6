"""LoRAPool (paging, byte budget, no fragmentation) and LoRABatchMeta (segments, tiles, buffers)."""

from __future__ import annotations

import pytest
import torch

from loraplane.kernels import RANK_LIMIT, LoRABatchMeta, LoRAPool, ModuleSpec, PoolFullError, lora_scale

SPEC = {"qkv": ModuleSpec(32, (32, 16, 16)), "down": ModuleSpec(48, (32,))}


def _pool(pages: int, **kw) -> LoRAPool:
    page = LoRAPool.page_bytes_for(SPEC, 2, 8, torch.float16)
    return LoRAPool(SPEC, 2, pages * page + page // 2, dtype=torch.float16, **kw)


def test_budget_sets_pages_and_bytes_follow_rank():
    pool = _pool(10)
    # one rank-row: qkv 3*32 + 64, down 48 + 32 elements; 2 layers; fp16; 8 rows a page
    assert pool.page_bytes == 8 * 2 * 2 * (3 * 32 + 64 + 48 + 32)
    assert pool.num_pages == 10 and pool.capacity_bytes == 10 * pool.page_bytes
    assert pool.bytes_for_rank(8) * 16 == pool.bytes_for_rank(128)
    assert pool.pages_for_rank(12) == 2
    with pytest.raises(ValueError, match="budget_bytes"):
        LoRAPool(SPEC, 2, 100)


def test_allocate_free_and_full():
    pool = _pool(10)
    a = pool.allocate(64, 0.5)  # 8 pages
    assert pool.free_pages == 2 and pool.rank_of(a) == 64 and int(pool.ranks[a]) == 64
    with pytest.raises(PoolFullError, match="needs 3 pages"):
        pool.allocate(24, 1.0)
    b = pool.allocate(16, 1.0)
    assert pool.free_pages == 0 and not pool.can_allocate(8)
    pool.free(a)
    assert pool.free_pages == 8 and int(pool.ranks[a]) == 0
    with pytest.raises(KeyError, match="not allocated"):
        pool.free(a)
    assert pool.rank_of(b) == 16


def test_no_fragmentation_after_interleaved_frees():
    """Free every other rank-8 adapter: a rank-32 adapter fits in the scattered holes."""
    pool = _pool(8)
    slots = [pool.allocate(8, 1.0) for _ in range(8)]
    for s in slots[::2]:
        pool.free(s)
    big = pool.allocate(32, 1.0)
    pages = pool.pages_of(big)
    assert len(pages) == 4 and sorted(pages) != list(range(min(pages), min(pages) + 4))
    table = pool.page_table[big, :4].tolist()
    assert table == pages


def test_write_places_rows_and_zeroes_unwritten_rank():
    pool = _pool(6)
    stale = pool.allocate(16, 1.0)
    for s in range(3):
        pool.write(stale, 1, "qkv", s, torch.randn(16, 32), torch.randn(SPEC["qkv"].out_dims[s], 16))
    pool.free(stale)
    slot = pool.allocate(24, lora_scale(16, 24, use_rslora=True))
    assert pool.scale_of(slot) == pytest.approx(16 / 24**0.5)
    a, b = torch.randn(20, 32), torch.randn(16, 20)  # rank_pattern: this module uses 20 of 24 rows
    pool.write(slot, 1, "qkv", 2, a, b)
    rows = pool.rows_of(slot)
    torch.testing.assert_close(pool.a[(1, "qkv")][2, rows[:20]].float(), a.half().float())
    torch.testing.assert_close(pool.bt[(1, "qkv")][rows[:20], 48:64].float(), b.t().half().float())
    assert (pool.bt[(1, "qkv")][rows][:, :48] == 0).all(), "stale rows of a reused page must read as zero"
    assert (pool.bt[(1, "qkv")][rows[20:]] == 0).all()
    with pytest.raises(ValueError, match="b must be"):
        pool.write(slot, 1, "qkv", 0, a, b)
    with pytest.raises(ValueError, match="slice_idx"):
        pool.write(slot, 1, "qkv", 3, a, b)
    with pytest.raises(ValueError, match=r"rank 129 is outside \[1, max_rank=128\]"):
        pool.allocate(129, 1.0)


@pytest.mark.parametrize("apart", [False, True], ids=["one-view", "apart"])
def test_reused_rows_read_zero_in_every_layer_and_write_layers_places_all(apart):
    """A pool's own buffers are one tensor per module (allocate zeroes a row in all layers in one kernel);
    a caller's per-layer buffers in separate tensors take the per-layer path. Both must zero the previous
    tenant's B rows in every layer, and ``write_layers`` must place every layer's rows."""
    spec, L, dt = {"down": ModuleSpec(48, (32,))}, 3, torch.float16
    bufs = None
    if apart:
        bufs = ({(i, "down"): torch.zeros(1, 16, 48, dtype=dt) for i in range(L)},
                {(i, "down"): torch.zeros(16, 32, dtype=dt) for i in range(L)})  # fmt: skip
    pool = LoRAPool(
        spec, L, 16 * LoRAPool.page_bytes_for(spec, L, 1, dt), page_rank=8, dtype=dt, buffers=bufs
    )
    assert (pool._bt_all["down"] is None) == apart
    old = pool.allocate(16, 1.0)
    for i in range(L):
        pool.write(old, i, "down", 0, torch.randn(16, 48), torch.randn(32, 16))
    pool.free(old)
    slot = pool.allocate(8, 1.0)
    rows = pool.rows_of(slot)
    for i in range(L):
        assert (pool.bt[(i, "down")][rows] == 0).all(), f"layer {i}: stale B rows of a reused page leak"
    a, b = torch.randn(L, 8, 48).to(dt), torch.randn(L, 32, 8).to(dt)
    pool.write_layers(slot, "down", a, b.transpose(1, 2))  # B^T through a transposed view
    for i in range(L):
        assert torch.equal(pool.a[(i, "down")][0, rows], a[i])
        assert torch.equal(pool.bt[(i, "down")][rows], b[i].T)
    with pytest.raises(ValueError, match=r"write_layers: need a \[3, 8, 48\]"):
        pool.write_layers(slot, "down", a[:, :4], b.transpose(1, 2))


def test_module_spec_validates():
    with pytest.raises(ValueError, match="out_dims"):
        ModuleSpec(32, (24, 0))
    with pytest.raises(ValueError, match="in_dim"):
        ModuleSpec(0, (32,))
    with pytest.raises(ValueError, match="at most 4"):
        ModuleSpec(8, (1, 2, 3, 4, 5))
    with pytest.raises(ValueError, match="slices overlap at columns 10..14"):
        ModuleSpec(8, (15, 4), slice_starts=(0, 10))
    with pytest.raises(ValueError, match="slice_starts must be a tuple of 2"):
        ModuleSpec(8, (15, 4), slice_starts=(0,))
    with pytest.raises(ValueError, match="y_width must be an int >= 22"):
        ModuleSpec(8, (15, 4), slice_starts=(3, 18), y_width=21)
    packed = ModuleSpec(8, (32, 16, 16))
    assert (
        packed.out_starts == (0, 32, 48, 64) and packed.slice_starts == (0, 32, 48) and packed.y_width == 64
    )
    assert packed == ModuleSpec(8, (32, 16, 16), slice_starts=(0, 32, 48), y_width=64)
    # Any width, any start: B^T stays packed in the pool, y places the slices anywhere.
    sharded = ModuleSpec(107, (15, 2049), slice_starts=(2052, 3))
    assert (
        sharded.out_starts == (0, 15, 2064)
        and sharded.y_width == 2067
        and sharded.row_elems() == 2 * 107 + 2064
    )


def test_rank_limit_is_one_number():
    with pytest.raises(
        ValueError, match=r"max_rank must be a multiple of page_rank=8 in \[1, 512\], got 1024"
    ):
        _pool(10, max_rank=1024)
    with pytest.raises(
        ValueError, match=r"max_rank must be a multiple of page_rank=1 in \[1, 512\], got 640"
    ):
        LoRABatchMeta(8, max_rank=640)
    pool = _pool(80, max_rank=512)
    slot = pool.allocate(512, 1.0)
    assert pool.pages_of(slot) == list(range(64)) and pool.max_rank == RANK_LIMIT


def test_meta_groups_tiles_and_skips_base_rows():
    ranks = [0, 8, 0, 64, 16]
    reqs = [(3, 2), (-1, 3), (1, 1), (3, 20), (4, 0), (-1, 1), (1, 2)]
    meta = LoRABatchMeta(40, tile_m=16).build(reqs, ranks)
    slots = meta.token_slot.tolist()
    assert slots[:29] == [3, 3, -1, -1, -1, 1] + [3] * 20 + [-1, 1, 1] and set(slots[29:]) == {-1}
    assert meta.num_tokens == 29 and meta.host_max_rank == 64
    n = int(meta.num_tiles)
    tiles = meta.tiles[:n].tolist()
    assert tiles == [[1, 0, 3], [3, 3, 16], [3, 19, 6]]
    order = meta.token_order[:25].tolist()
    assert order[:3] == [5, 27, 28] and sorted(order[3:]) == [0, 1] + list(range(6, 26))
    covered = [order[t] for s, st, c in tiles for t in range(st, st + c)]
    assert sorted(covered) == sorted(i for i, s in enumerate(slots) if s >= 0)
    assert [(s, idx.tolist()) for s, idx in meta.groups][0] == (1, [5, 27, 28])


def test_meta_rebuild_reuses_buffers_and_validates():
    meta = LoRABatchMeta(8, capture=True)
    ptr = meta.tiles.data_ptr()
    meta.build([(0, 8)], [16])
    assert int(meta.num_tiles) == 1
    meta.build([(-1, 4)], [16])
    assert int(meta.num_tiles) == 0 and meta.tiles.data_ptr() == ptr and meta.groups == []
    with pytest.raises(ValueError, match="capacity"):
        meta.build([(0, 9)], [16])
    with pytest.raises(ValueError, match=r"requests\[1\].slot"):
        meta.build([(0, 1), (1, 1)], [16, 0])
    with pytest.raises(ValueError, match="num_tokens"):
        meta.build([(0, -1)], [16])
    with pytest.raises(ValueError, match="tile_m"):
        LoRABatchMeta(8, tile_m=24)
    with pytest.raises(ValueError, match=r"rank 32 is outside \[1, max_rank=16\]"):
        LoRABatchMeta(8, capture=True, max_rank=16).build([(0, 2)], [32])


def _grouping_by_hand(reqs, tile_m):
    """The metadata's contract written as plain loops: rows grouped by slot (stable), tiles of tile_m."""
    token_slot = [s for s, n in reqs for _ in range(n)]
    order = sorted((r for r, s in enumerate(token_slot) if s >= 0), key=lambda r: token_slot[r])
    tiles, i = [], 0
    while i < len(order):
        slot, j = token_slot[order[i]], i
        while j < len(order) and token_slot[order[j]] == slot:
            j += 1
        tiles += [[slot, t0, min(tile_m, j - t0)] for t0 in range(i, j, tile_m)]
        i = j
    return token_slot, order, tiles


@pytest.mark.parametrize("seed", range(6))
def test_meta_build_equals_the_grouping_by_hand(seed):
    """Random steps (base-only rows, empty requests, groups longer than a tile, rebuilt into the same
    buffers): token slots, order, tiles, groups and the largest rank match plain loops."""
    gen = torch.Generator().manual_seed(seed)
    ranks = [0, 8, 16, 0, 64, 4, 32]
    meta = LoRABatchMeta(96, tile_m=16)
    for _ in range(3):
        n = int(torch.randint(0, 12, (1,), generator=gen))
        slots = [[-1, 1, 2, 4, 5, 6][int(i)] for i in torch.randint(0, 6, (n,), generator=gen)]
        reqs = [(s, int(c)) for s, c in zip(slots, torch.randint(0, 9, (n,), generator=gen), strict=True)]
        token_slot, order, tiles = _grouping_by_hand(reqs, 16)
        meta.build(reqs, ranks)
        T = len(token_slot)
        assert meta.num_tokens == T and meta.token_slot[:T].tolist() == token_slot
        assert set(meta.token_slot[T:].tolist()) <= {-1}
        assert meta.token_order[: len(order)].tolist() == order
        assert int(meta.num_tiles) == meta.host_num_tiles == len(tiles)
        assert meta.tiles[: len(tiles)].tolist() == tiles and not meta.tiles[len(tiles) :].any()
        assert [(s, idx.tolist()) for s, idx in meta.groups] == [
            (s, [r for r in order if token_slot[r] == s]) for s in sorted({t[0] for t in tiles})
        ]
        assert meta.host_max_rank == max((ranks[t[0]] for t in tiles), default=0)


def test_meta_odd_requests_name_the_first_bad_one():
    meta = LoRABatchMeta(8)
    with pytest.raises(ValueError, match=r"requests\[1\] must be \(slot, num_tokens\)"):
        meta.build([(0, 1), (0, 1, 2)], [16])
    with pytest.raises(ValueError, match=r"requests\[0\] must be \(slot, num_tokens\)"):
        meta.build([("x", 1)], [16])
    with pytest.raises(ValueError, match=r"requests\[2\].slot 5"):
        meta.build([(0, 1), (-1, 1), (5, 1)], [16])
    assert meta.build([], [16]).num_tokens == 0 and int(meta.num_tiles) == 0
