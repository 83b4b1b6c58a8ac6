"""The GPU memory arbiter of the split: one fixed KV share handed over whole, nothing to trade, no stats; and
the layouts that build each mode's arbiter in one place."""

from __future__ import annotations

import pytest

from loraplane.engine.core.block_manager import BlockManager
from loraplane.engine.core.sequence import Sequence
from loraplane.engine.memory.arbiter import FREE, KV, SplitMemory


def test_split_memory_hands_every_block_over_once():
    mem = SplitMemory(8)
    assert (mem.num_chunks, mem.chunk_blocks, mem.num_free_chunks) == (1, 8, 1)
    assert mem.take_kv_chunk() == range(8) and mem.kind == [KV] and mem.num_free_chunks == 0
    assert mem.take_kv_chunk() is None
    mem.reclaim_for_kv(1, frozenset({"x@v1"}))  # nothing to reclaim from: a no-op
    assert mem.stats(3) is None
    with pytest.raises(ValueError, match="chunk 0"):
        mem.give_kv_chunk(0)
    with pytest.raises(ValueError, match="num_blocks"):
        SplitMemory(0)


def test_block_manager_over_the_split_takes_blocks_lowest_first():
    bm = BlockManager(num_blocks=6, block_size=2)  # no memory given: the split's arbiter
    assert isinstance(bm.memory, SplitMemory) and bm.memory.kind == [FREE]
    assert bm.num_free_blocks == 6
    a, b = Sequence(list(range(5))), Sequence(list(range(3)))
    bm.allocate(a, 5)
    bm.allocate(b, 3)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4] and bm.num_free_blocks == 1
    assert not bm.make_room(2) and bm.make_room(1)
    assert not bm.memory.reserves_kv  # no adapter competes for the split's KV: nothing to reserve
    assert bm.idle_kv_chunks() == 0 and bm.release_idle_kv_chunks(1) == 0


@pytest.mark.parametrize("mode", ["split", "unified"])
def test_each_mode_builds_its_arbiter_in_one_place(mode, tiny_llama_dir):
    torch = pytest.importorskip("torch")
    from loraplane.engine.core.config import EngineConfig
    from loraplane.engine.memory.layout import memory_layout
    from loraplane.engine.model.model_config import ModelConfig

    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", memory_mode=mode, enable_lora=True,
                          max_loras=2, max_lora_rank=8)  # fmt: skip
    cfg = ModelConfig.from_pretrained(str(tiny_llama_dir), None)
    layout = memory_layout(config, cfg, 8, torch.float32, torch.device("cpu"))
    early = layout.pools_before_kv()
    blocks = layout.kv_blocks(100)
    placed = layout.allocate(blocks)
    assert len(placed.kv_caches) == cfg.num_layers and placed.memory.num_blocks == blocks
    assert placed.kv_caches[0][0].shape == (blocks, 8, cfg.num_kv_heads, cfg.head_dim)
    if mode == "split":  # pools of their own, sized before KV; KV gets what it was given
        assert early is not None and placed.pools is None and blocks == 100
        assert placed.memory.stats() is None
    else:  # the pools are views over the arena; the arena holds what the split gave both, in whole chunks
        assert early is None and placed.pools is not None and placed.gpu_tier is not None
        assert blocks > 100 and blocks % placed.memory.chunk_blocks == 0
        assert placed.memory.stats()["free_chunks"] == placed.memory.num_chunks
