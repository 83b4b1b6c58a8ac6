"""An adapter's rows land in its slot's pages exactly, whether the pages are consecutive (a fresh pool) or
scattered one by one (a pool that has evicted adapters of other ranks in between)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from loraplane.engine.lora.layers import build_pools  # noqa: E402
from loraplane.engine.lora.tiers import MAX_RUNS, GpuTier, _row_runs  # noqa: E402
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
    assert len(_row_runs(pool, tier.slots["scattered"]["q_proj"])) > MAX_RUNS
    assert_placed(tier, "scattered", scattered)
    for n in range(1, 8, 2):
        assert_placed(tier, f"s{n}", small[n])
    tier.start_copy("fresh", fresh)
    assert_placed(tier, "fresh", fresh)
