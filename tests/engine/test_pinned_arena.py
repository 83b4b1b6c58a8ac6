"""The host tier's arena: a block returns only when no tensor on it is left (a copy in flight keeps it), free
runs merge, a full arena evicts host entries until a load fits, and an engine whose every load goes through
a full arena serves the same tokens as one without it."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from loraplane.engine.lora.pinned import ALIGN, PinnedArena, take_or_evict
from loraplane.engine.lora.safetensors_io import read_file
from tests.engine.test_adapter_churn import GREEDY, PROMPT, load_all, make_async, to_disk

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_block_comes_back_only_when_its_last_view_dies():
    arena = PinnedArena(64 * ALIGN, pin=False)
    block = arena.take(10 * ALIGN + 1)
    assert block.numel() == 10 * ALIGN + 1 and block.dtype == torch.uint8
    assert arena.used == 11 * ALIGN
    view = block[: 10 * ALIGN].view(torch.bfloat16).view(10, -1)  # what a module's factor looks like
    view.fill_(1.5)
    del block
    gc.collect()
    assert arena.used == 11 * ALIGN, "a view still reads the block"
    again = arena.take(53 * ALIGN)
    assert again is not None and arena.take(ALIGN) is None
    assert float(view.float().mean()) == 1.5, "the live view's bytes were handed out again"
    del view, again
    gc.collect()
    assert arena.used == 0


def test_free_runs_merge_so_a_large_block_fits_again():
    arena = PinnedArena(12 * ALIGN, pin=False)
    blocks = [arena.take(4 * ALIGN) for _ in range(3)]
    assert arena.take(ALIGN) is None
    del blocks[0], blocks[1]  # the first and the third third: two runs of 4 pages, not adjacent
    gc.collect()
    assert arena.largest_free == 4 * ALIGN and arena.take(8 * ALIGN) is None
    blocks.clear()
    gc.collect()
    assert arena.largest_free == 12 * ALIGN and arena.take(12 * ALIGN) is not None


def test_take_or_evict_evicts_until_it_fits_and_gives_up_when_nothing_can_go():
    arena = PinnedArena(8 * ALIGN, pin=False)
    held = {name: arena.take(4 * ALIGN) for name in ("a", "b")}
    order = []

    def evict_one() -> bool:
        if not held:
            return False
        name = next(iter(held))
        order.append(name)
        del held[name]
        return True

    block = take_or_evict(arena, 6 * ALIGN, evict_one, wait_s=1.0)
    assert block is not None and order == ["a", "b"]
    assert take_or_evict(arena, 4 * ALIGN, lambda: False, wait_s=0.05) is None  # held by `block`
    assert take_or_evict(arena, 9 * ALIGN, evict_one, wait_s=0.05) is None  # larger than the arena


def test_arena_size_is_checked():
    with pytest.raises(ValueError, match="nbytes"):
        PinnedArena(100, pin=False)


def test_loads_through_a_full_arena_evict_host_entries_and_tokens_are_unchanged(adapters):
    base, folders = adapters
    names = ("hot", "cold1", "cold2")

    async def serve(arena: bool) -> tuple[list[list[int]], int, int]:
        engine = make_async(
            base, max_loras=1, max_lora_rank=8
        )  # one adapter on the GPU: every switch loads from the host
        lora = engine.engine.runner.lora
        reads = []
        try:
            await load_all(engine, folders, names)
            lora.read = lambda path: reads.append(path) or read_file(path)
            one = lora.host.entries["hot@v1"].nbytes
            if arena:  # room for two adapters: the third load must evict a host entry
                lora.arena = PinnedArena(2 * one + 2 * ALIGN, pin=False)
            to_disk(engine, *names)
            out = []
            for name in (*names, *names):
                tokens = []
                async for o in engine.add_request(PROMPT, GREEDY, adapter=f"{name}@v1"):
                    tokens += o.new_token_ids
                out.append(tokens)
            if arena:
                assert len(lora.host.entries) == 2 and all(
                    _inside(lora.arena, w) for w in lora.host.entries.values()
                )
            return out, lora.arena_misses, len(reads)
        finally:
            await engine.aclose()

    plain, _, plain_reads = asyncio.run(serve(False))
    through, misses, reads = asyncio.run(serve(True))
    assert through == plain and misses == 0
    assert plain_reads == 3 and reads == 6, "with room for two, each round reads every file again"


def test_a_warm_up_that_reads_on_the_engine_thread_never_deadlocks_on_a_full_arena(adapters):
    """A start-up warm-up (``only_if_room``) waits for its parse on the engine thread, holding the tiers'
    lock; the parse finds the arena full and must not wait for that lock to evict: it takes pageable
    memory once the arena's wait runs out."""
    base, folders = adapters

    async def main():
        engine = make_async(base, max_loras=2, max_lora_rank=8)
        lora = engine.engine.runner.lora
        try:
            await load_all(engine, folders, ("hot", "cold1"))
            one = lora.host.entries["hot@v1"].nbytes
            to_disk(engine, "hot", "cold1")
            lora.arena = PinnedArena(one + ALIGN, pin=False)  # room for one adapter
            async for _ in engine.add_request(PROMPT, GREEDY, adapter="hot@v1"):
                pass
            assert _inside(lora.arena, lora.host.entries["hot@v1"]) and lora.arena.take(ALIGN * 2) is None
            info = await asyncio.wait_for(engine.warm_adapter("cold1", "v1", only_if_room=True), 20)
            assert info.tier == "gpu" and lora.arena_misses == 1
        finally:
            await engine.aclose()

    asyncio.run(main())


def _inside(arena: PinnedArena, weights) -> bool:
    start = arena._mem.ctypes.data
    return all(
        start <= t.data_ptr() < start + arena.capacity for t in (*weights.a.values(), *weights.b.values())
    )


@pytest.fixture(scope="module")
def adapters(make_hf_model, tmp_path_factory):
    from tests.engine.test_adapter_churn import adapters as churn_adapters

    return churn_adapters.__wrapped__(make_hf_model, tmp_path_factory)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_an_arena_dropped_without_close_unlocks_its_pages_and_leaves_no_error():
    """Engines come and go in one process (tests, a reload): a dropped arena's range must be unlocked before
    it is unmapped, or the next map at that address fails to register, and the failed call's error is then
    raised by whichever CUDA call comes next."""
    for _ in range(4):  # the same size each time, so the kernel hands back the same addresses
        arena = PinnedArena(256 * ALIGN, pin=True)
        assert arena.pinned and arena._unlock is not None, "registered with cudaHostRegister, not a fallback"
        block = arena.take(ALIGN)
        block.fill_(3)
        on_device = block.to("cuda", non_blocking=True)
        torch.cuda.synchronize()  # the copy has read the block before the arena goes
        del arena, block
        gc.collect()
        assert int(on_device.sum()) == 3 * ALIGN
        torch.zeros(4, device="cuda").add_(1)  # a later launch does not raise an earlier call's error
    torch.cuda.synchronize()


def test_an_adapter_in_use_on_the_gpu_gives_its_host_block_back(adapters):
    """While a request streams from an adapter with GPU rows, its host copy is evictable (the GPU copy serves
    it), so the host tier never fills with adapters already on the GPU and new loads keep finding room.
    Before that, the host copy of every adapter with a running request stayed, however long it ran."""
    base, folders = adapters

    async def main() -> tuple[bool, bool, list[int]]:
        engine = make_async(base, max_loras=2, max_lora_rank=8)
        lora = engine.engine.runner.lora
        try:
            await load_all(engine, folders, ("hot",))
            to_disk(engine, "hot")
            evictable_in_use, tokens = [], []
            async for out in engine.add_request(PROMPT, GREEDY, adapter="hot@v1"):
                tokens += out.new_token_ids
                with lora.lock:
                    if lora.versions["hot@v1"].in_flight:
                        evictable_in_use.append(lora._host_evictable("hot@v1"))
            return all(evictable_in_use) and bool(evictable_in_use), lora.tier_of("hot@v1") == "gpu", tokens
        finally:
            await engine.aclose()

    evictable, on_gpu, tokens = asyncio.run(main())
    assert on_gpu and tokens
    assert evictable, "the host copy of an adapter on the GPU was held for its running request"
