"""An adapter's rows land in its slot's pages exactly, whether the pages are consecutive (a fresh pool) or
scattered one by one (a pool that has evicted adapters of other ranks in between); rows that held another
adapter or KV never leak into a new one; and a load's tensor work does not grow with the layers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from loraplane.engine.lora.layers import build_pools  # noqa: E402
from loraplane.engine.lora.tiers import GpuTier  # noqa: E402
from loraplane.engine.lora.weights import AdapterWeights, module_shapes  # noqa: E402
from loraplane.engine.model.model_config import ModelConfig  # noqa: E402

RAW = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 32,
       "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}  # fmt: skip


def adapter(cfg: ModelConfig, rank: int, seed: int) -> AdapterWeights:
    gen, L = torch.Generator().manual_seed(seed), cfg.num_layers
    out = AdapterWeights(a={}, b={})
    for m, (fan_in, fan_out) in module_shapes(cfg).items():
        out.a[m] = torch.randn(L, rank, fan_in, generator=gen)  # [L, r, in]
        out.b[m] = torch.randn(L, fan_out, rank, generator=gen)  # [L, out, r]
        out.ranks[m] = rank
    return out


def assert_placed(tier: GpuTier, key: str, w: AdapterWeights) -> None:
    for m, slot in tier.slots[key].items():
        pool, rows = tier.pools[m], tier.pools[m].rows_of(slot)
        for i in range(pool.num_layers):
            assert torch.equal(pool.a[(i, m)][0, rows], w.a[m][i])
            assert torch.equal(pool.bt[(i, m)][rows], w.b[m][i].T)


def test_rows_land_in_consecutive_and_in_scattered_pages():
    cfg = ModelConfig.from_dict(RAW, max_model_len=256)
    tier = GpuTier(build_pools(cfg, 24, 8, torch.float32, torch.device("cpu")), torch.device("cpu"))
    small = [adapter(cfg, 1, seed) for seed in range(8)]
    for n, w in enumerate(small):  # eight rank-1 adapters fill rows one by one
        tier.start_copy(f"s{n}", w)
    for n in range(0, 8, 2):  # every other one leaves: single free rows between live ones
        tier.evict(f"s{n}")
    fresh = adapter(cfg, 8, 100)
    tier.start_copy("fresh", fresh)  # 8 rows: the 4 scattered free rows + 4 consecutive ones
    scattered = adapter(cfg, 4, 200)
    tier.evict("fresh")
    tier.start_copy("scattered", scattered)
    pool = next(iter(tier.pools.values()))
    pages = pool.pages_of(tier.slots["scattered"]["q_proj"])
    assert sum(b != a + 1 for a, b in zip(pages, pages[1:], strict=False)) >= 2, pages  # three runs or more
    assert_placed(tier, "scattered", scattered)
    for n in range(1, 8, 2):
        assert_placed(tier, f"s{n}", small[n])
    tier.start_copy("fresh", fresh)
    assert_placed(tier, "fresh", fresh)


def config(layers: int) -> ModelConfig:
    return ModelConfig.from_dict({**RAW, "num_hidden_layers": layers}, max_model_len=256)


def test_a_lower_rank_adapter_in_reused_rows_reads_no_stale_values():
    """Allocation no longer zeroes the rows (the copy writes them all): a rank-8 adapter whose layer 1 uses
    only 3 rows (zero-padded by the loader, as rank_pattern gives) must read exact zeros there, not the
    previous tenant's values, in A and B of every layer."""
    cfg = config(3)
    tier = GpuTier(build_pools(cfg, 8, 8, torch.float32, torch.device("cpu")), torch.device("cpu"))
    old = adapter(cfg, 8, 1)
    tier.start_copy("old", old)
    tier.evict("old")
    new = adapter(cfg, 8, 2)
    for m in new.a:  # layer 1 at rank 3: rows 3..7 are zeros in the loader's stacked factors
        new.a[m][1, 3:] = 0
        new.b[m][1, :, 3:] = 0
    tier.start_copy("new", new)
    assert sorted(tier.pools["q_proj"].pages_of(tier.slots["new"]["q_proj"])) == list(range(8))  # same rows
    assert_placed(tier, "new", new)
    rows = tier.pools["q_proj"].rows_of(tier.slots["new"]["q_proj"])
    assert (tier.pools["q_proj"].bt[(1, "q_proj")][rows[3:]] == 0).all()


_NO_KERNEL = set("slice select view transpose detach lift_fresh as_strided _local_scalar_dense".split())


class _Ops(TorchDispatchMode):
    """Counts the aten ops that launch work on a device (views and host scalars aside) run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ not in _NO_KERNEL
        return func(*args, **(kwargs or {}))


def ops_per_load(layers: int, unified: bool) -> int:
    cfg = config(layers)
    if unified:
        from loraplane.engine.memory.pool import UnifiedGpuTier, build_unified, chunk_blocks_for

        blocks = 4 * chunk_blocks_for(cfg, 16)
        _, memory, pools = build_unified(cfg, blocks, 16, 8, torch.float32, torch.device("cpu"), True)
        tier = UnifiedGpuTier(pools, memory, torch.device("cpu"))
    else:
        tier = GpuTier(build_pools(cfg, 24, 8, torch.float32, torch.device("cpu")), torch.device("cpu"))
    for n in range(4):  # scatter the free rows: loads then land in pages that are not consecutive
        tier.start_copy(f"s{n}", adapter(cfg, 2, n))
    tier.evict("s0")
    tier.evict("s2")
    w = adapter(cfg, 4, 9)
    with _Ops() as ops:
        tier.start_copy("w", w)
    assert_placed(tier, "w", w)
    return ops.count


@pytest.mark.parametrize("unified", [False, True], ids=["split", "unified"])
def test_a_load_runs_the_same_ops_for_any_number_of_layers(unified):
    """The engine thread's cost per load: a few tensor ops per module (the table row, two indexed copies),
    not one or two per layer and module as a per-layer zeroing or placement made it (448 on an 8B model)."""
    few, many = ops_per_load(2, unified), ops_per_load(8, unified)
    assert few == many, (few, many)
    assert many <= 5 * 7, many
