"""Unified memory in the engine (tiny Llama, fp32, CPU): at the same total bytes as a fixed split, many
adapters with short contexts keep more adapters resident, long contexts with few adapters run more sequences,
the share moves both ways within one run, tokens stay those of a roomy split engine, and what a queued or
running request needs, or a pinned adapter, is never evicted for KV."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams  # noqa: E402
from loraplane.engine.memory.allocator import KV  # noqa: E402
from tests.engine.peft_adapters import save_peft_adapter  # noqa: E402
from tests.numerics import assert_close_sums  # noqa: E402

NUM_ADAPTERS = 12
KV_BLOCKS = 256  # the split's KV: 256 blocks of 4 tokens (512 KiB); its adapter pools as much again
POOL_BYTES = 512 << 10  # 64 rank-rows per module: eight r8 adapters on every module
SPLIT_ADAPTERS = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("unified")
    spec = dict(r=8, lora_alpha=16, target_modules="all-linear")
    return {
        f"a{i}": save_peft_adapter(tiny_llama_dir, root / f"a{i}", seed=100 + i, **spec)
        for i in range(NUM_ADAPTERS)
    }


def make_engine(base, folders, mode, **kw) -> LLMEngine:
    torch.set_num_threads(1)
    opts = dict(
        device="cpu", block_size=4, num_kv_blocks=KV_BLOCKS, lora_pool_bytes=POOL_BYTES, max_lora_rank=16
    )
    cfg = EngineConfig(model=str(base), max_num_batched_tokens=512, memory_mode=mode, **(opts | kw))
    engine = LLMEngine(cfg)
    lora = engine.runner.lora
    for name, folder in folders.items():
        lora.register(name, "v1", folder, f"sha256:{name}", lora.parse(folder))
    return engine


def short_phase(seed: int) -> list[tuple[list[int], str, SamplingParams]]:
    """Every adapter, two short requests each."""
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    names = [f"a{i}@v1" for i in range(NUM_ADAPTERS)] * 2
    return [([rng.randrange(1, 256) for _ in range(rng.randrange(3, 9))], n, sampling) for n in names]


def long_phase(seed: int, count: int = 16) -> list[tuple[list[int], str | None, SamplingParams]]:
    """A few long requests on one adapter and the base: 27 blocks of 4 tokens each."""
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [
        ([rng.randrange(1, 256) for _ in range(100)], "a0@v1" if i % 2 else None, sampling)
        for i in range(count)
    ]


def run(engine: LLMEngine, requests) -> dict:
    """Run requests together to completion; tokens per request, peak running sequences, and resident adapters."""
    seqs = [engine.add_request(p, s, adapter=a) for p, a, s in requests]
    peak_running = peak_resident = 0
    while engine.has_unfinished():
        engine.step()
        peak_running = max(peak_running, len(engine.scheduler.running))
        peak_resident = max(peak_resident, len(engine.runner.lora.gpu.slots))
    assert all(seq.finish_reason == "length" for seq in seqs), [seq.error for seq in seqs]
    return dict(tokens=[list(seq.output_token_ids) for seq in seqs], running=peak_running,
                resident=len(engine.runner.lora.gpu.slots), peak_resident=peak_resident)  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, folders):
    """Tokens of a split engine with room for everything at once (no eviction, no preemption)."""
    engine = make_engine(tiny_llama_dir, folders, "split", num_kv_blocks=1024, lora_pool_bytes=None,
                         max_loras=NUM_ADAPTERS)  # fmt: skip
    out = {}
    for name, requests in (("short", short_phase(1)), ("long", long_phase(2)), ("short2", short_phase(3))):
        out[name] = run(engine, requests)["tokens"]
    assert engine.num_preemptions == 0
    return out


def test_same_total_bytes(tiny_llama_dir, folders):
    split = make_engine(tiny_llama_dir, folders, "split")
    unified = make_engine(tiny_llama_dir, folders, "unified")
    split_bytes = (
        split.runner.num_kv_blocks * split.runner.kv_block_bytes + split.runner.lora.gpu.capacity_bytes
    )
    memory = unified.runner.memory
    assert memory.num_blocks * memory.block_bytes == split_bytes == 2 * POOL_BYTES
    assert unified.runner.model.model.layers[0].self_attn.k_cache.is_contiguous()


def test_many_adapters_short_contexts_keep_more_resident(tiny_llama_dir, folders, reference):
    split = run(make_engine(tiny_llama_dir, folders, "split"), short_phase(1))
    unified = run(make_engine(tiny_llama_dir, folders, "unified"), short_phase(1))
    assert split["peak_resident"] <= SPLIT_ADAPTERS < unified["resident"]
    assert split["tokens"] == unified["tokens"] == reference["short"]


def test_long_contexts_few_adapters_run_more_sequences(tiny_llama_dir, folders, reference):
    split_engine = make_engine(tiny_llama_dir, folders, "split")
    split = run(split_engine, long_phase(2))
    unified_engine = make_engine(tiny_llama_dir, folders, "unified")
    unified = run(unified_engine, long_phase(2))
    assert split["running"] <= KV_BLOCKS // 27 < unified["running"]
    assert split["tokens"] == unified["tokens"] == reference["long"]


def test_the_share_moves_both_ways_in_one_run(tiny_llama_dir, folders, reference):
    engine = make_engine(tiny_llama_dir, folders, "unified")
    memory = engine.runner.memory
    first = run(engine, short_phase(1))
    adapter_chunks_first = memory.stats()["adapter_chunks"]
    assert first["resident"] > SPLIT_ADAPTERS and first["tokens"] == reference["short"]

    long = run(engine, long_phase(2))  # KV takes the idle adapters' chunks (no preemption needed)
    assert long["running"] > KV_BLOCKS // 27 and long["tokens"] == reference["long"]
    assert long["resident"] < first["resident"] and memory.kind.count(KV) * memory.chunk_blocks > KV_BLOCKS

    again = run(engine, short_phase(3))  # adapters take the idle KV chunks back
    assert again["resident"] > SPLIT_ADAPTERS and again["tokens"] == reference["short2"]
    assert memory.stats()["adapter_chunks"] >= adapter_chunks_first - 1
    assert engine.num_preemptions == 0
    stats = engine.stats().unified_memory
    assert (
        stats["bytes_kv"] + stats["bytes_adapters"] + stats["bytes_free"]
        == memory.num_blocks * memory.block_bytes
    )
    assert (
        stats["bytes_adapters"] > 0 and stats["kv_blocks_used"] == 0 and 0 <= stats["row_fragmentation"] < 1
    )


def test_needed_and_pinned_adapters_are_never_evicted_for_kv(tiny_llama_dir, folders):
    engine = make_engine(tiny_llama_dir, folders, "unified")
    lora = engine.runner.lora
    for name in folders:  # every adapter resident: a0 pinned, a1 running, a2 queued, the others idle
        lora.ensure_resident([f"{name}@v1"])
    assert engine.runner.memory.num_free_chunks * 16 < 125  # too little left for the long request
    lora.set_pinned("a0@v1", True)
    sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    running = engine.add_request([5] * 8, sampling, adapter="a1@v1")
    engine.step()  # a1's request runs
    long = engine.add_request([7] * 380, SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
    queued = engine.add_request([9] * 8, sampling, adapter="a2@v1")
    engine.scheduler.max_num_seqs = 2  # a2's request waits while the long base request grows
    evicted = False
    while not long.is_finished:
        engine.step()
        for seq, key in ((running, "a1@v1"), (queued, "a2@v1")):
            if not seq.is_finished:
                assert lora.tier_of(key) == "gpu"
        assert lora.tier_of("a0@v1") == "gpu"
        evicted = evicted or any(lora.tier_of(f"a{i}@v1") != "gpu" for i in range(3, NUM_ADAPTERS))
    assert evicted  # idle ones made room for KV
    while engine.has_unfinished():
        engine.step()
    assert queued.finish_reason == running.finish_reason == long.finish_reason == "length"


def test_unified_needs_one_process(tiny_llama_dir):
    with pytest.raises(ValueError, match="memory_mode"):
        EngineConfig(model=str(tiny_llama_dir), memory_mode="unified", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="memory_mode"):
        EngineConfig(model=str(tiny_llama_dir), memory_mode="shared")


def test_mixed_ranks_in_poisoned_memory_match_the_split(tiny_llama_dir, tmp_path):
    """Every adapter kind (ranks 8..64, rsLoRA, rank_pattern, q,v-only, MLP-only) in a unified memory first
    filled with NaN, small enough that adapters and KV keep trading chunks: a value never written (a stale
    row, a row past a module's rank, a KV slot) that were read would turn the tokens into garbage."""
    from tests.engine.peft_adapters import ADAPTER_SPECS

    kinds = {
        n: save_peft_adapter(tiny_llama_dir, tmp_path / n, seed=i, **s)
        for i, (n, s) in enumerate(ADAPTER_SPECS.items())
    }
    mix = [None, "r8", "r16", None, "r64", "rslora", "pattern", "qv", "mlp", "r8", None] * 2
    rng = random.Random(5)
    sampling = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    requests = [
        (
            [rng.randrange(1, 256) for _ in range(rng.randrange(3, 60))],
            None if a is None else f"{a}@v1",
            sampling,
        )
        for a in mix
    ]
    roomy = make_engine(
        tiny_llama_dir,
        kinds,
        "split",
        num_kv_blocks=1024,
        lora_pool_bytes=None,
        max_loras=8,
        max_lora_rank=64,
    )
    unified = make_engine(
        tiny_llama_dir, kinds, "unified", num_kv_blocks=64, lora_pool_bytes=1 << 20, max_lora_rank=64
    )
    for layer in unified.runner.model.model.layers:
        layer.self_attn.k_cache.fill_(float("nan"))
        layer.self_attn.v_cache.fill_(float("nan"))  # the whole arena: KV and adapter rows
    expected = run(roomy, requests)["tokens"]
    got = run(unified, requests)
    assert got["tokens"] == expected
    assert unified.runner.memory.stats()["adapter_chunks"] > 0


@pytest.mark.gpu
def test_gpu_unified_with_cuda_graphs_matches_the_split(tiny_llama_dir, folders):
    """Triton kernels over the arena's strided views, CUDA-graph decode, NaN-filled arena: the split's tokens."""
    kw = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=16)
    requests = short_phase(7) + long_phase(8, count=4)
    split = make_engine(tiny_llama_dir, folders, "split", enforce_eager=True, **kw)
    unified = make_engine(tiny_llama_dir, folders, "unified", enforce_eager=False, **kw)
    assert unified.runner.graphs is not None
    for layer in unified.runner.model.model.layers:
        layer.self_attn.k_cache.fill_(float("nan"))
        layer.self_attn.v_cache.fill_(float("nan"))
    assert run(unified, requests)["tokens"] == run(split, requests)["tokens"]


def test_prefix_cache_goes_with_a_chunk_that_adapters_take(tiny_llama_dir, folders):
    """A cached prefix whose chunk is handed to adapter rows is forgotten (its blocks now hold weights), and the
    same prompt then recomputes to the same tokens."""
    engine = make_engine(tiny_llama_dir, folders, "unified", num_kv_blocks=64, lora_pool_bytes=POOL_BYTES)
    prompt = [random.Random(9).randrange(1, 256) for _ in range(41)]
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = engine.generate([prompt], sampling)
    block_manager = engine.scheduler.block_manager
    probe = engine.add_request(prompt, sampling)
    assert len(block_manager.lookup(probe)) == 10  # every full block of the prompt is cached
    engine.abort(probe.request_id)
    lora = engine.runner.lora
    for name in folders:  # adapters take every chunk they can, idle KV chunks included
        lora.ensure_resident([f"{name}@v1"])
    probe = engine.add_request(prompt, sampling)
    assert len(block_manager.lookup(probe)) < 10
    engine.abort(probe.request_id)
    assert engine.generate([prompt], sampling) == first


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_over_arena_views_equal_plain_pools(backend):
    """The arena pools' strided views (A and B^T side by side in one row) through both kernel paths (Triton
    interpreted on the CPU) give what ordinary contiguous pools give, for mixed ranks in one batch."""
    import os

    from loraplane.engine.memory.pool import build_unified, chunk_blocks_for
    from loraplane.engine.model.model_config import ModelConfig
    from loraplane.kernels import LoRABatchMeta, LoRAPool, lora_apply

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU Triton needs TRITON_INTERPRET=1")
    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "max_position_embeddings": 64})  # fmt: skip
    blocks = 4 * chunk_blocks_for(cfg, 4)
    _, memory, arena_pools = build_unified(cfg, blocks, 4, 16, torch.float32, torch.device("cpu"), True)
    gen = torch.Generator().manual_seed(0)
    ranks = {0: 16, 1: 3, 2: 8}
    reqs = [(0, 3), (-1, 2), (1, 4), (2, 1), (0, 2)]
    meta = LoRABatchMeta(16, "cpu", tile_m=16).build(
        reqs, [ranks.get(s, 0) for s in range(arena_pools["q_proj"].max_adapters)]
    )
    for module in ("k_proj", "down_proj"):
        arena = arena_pools[module]
        spec = arena.modules[module]
        plain = LoRAPool({module: spec}, 2, 64 * LoRAPool.page_bytes_for({module: spec}, 2, 1, torch.float32),
                         page_rank=1, max_rank=16, max_adapters=arena.max_adapters, dtype=torch.float32)  # fmt: skip
        for slot, r in ranks.items():
            for pool in (arena, plain):
                pool.allocate(r, 0.5, slot=slot)
            for layer in range(2):
                a = torch.randn(r, spec.in_dim, generator=gen)
                b = torch.randn(spec.out_dims[0], r, generator=gen)
                for pool in (arena, plain):
                    pool.write(slot, layer, module, 0, a, b)
        x = torch.randn(12, spec.in_dim, generator=gen)
        y0 = torch.randn(12, spec.out_dims[0], generator=gen)
        got = lora_apply(y0.clone(), x, arena, 1, module, meta, backend=backend)
        want = lora_apply(y0.clone(), x, plain, 1, module, meta, backend="torch")
        assert_close_sums(got, want, terms=spec.in_dim + 16)  # x @ A^T over in_dim, then @ B^T over rank
    assert memory.stats()["adapter_chunks"] > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("modules", [("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj")])
def test_packed_projections_over_arena_views(backend, modules):
    """One call for the modules packed in a projection (gate and up share a row width, so they share one
    row space and one launch; q, k and v have two widths): the same as each module alone over plain pools."""
    import os

    from loraplane.engine.memory.pool import build_unified, chunk_blocks_for
    from loraplane.engine.model.model_config import ModelConfig
    from loraplane.kernels import LoRABatchMeta, LoRAPool, lora_apply, lora_apply_many

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU Triton needs TRITON_INTERPRET=1")
    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "max_position_embeddings": 64})  # fmt: skip
    _, _, arena_pools = build_unified(
        cfg, 4 * chunk_blocks_for(cfg, 4), 4, 16, torch.float32, torch.device("cpu"), True
    )
    gen = torch.Generator().manual_seed(1)
    ranks = {0: 16, 1: 5, 3: 8}
    slots = arena_pools["q_proj"].max_adapters
    meta = LoRABatchMeta(16, "cpu", tile_m=16).build(
        [(3, 2), (0, 4), (-1, 1), (1, 3)], [ranks.get(s, 0) for s in range(slots)]
    )
    plain, starts, col = {}, [], 0
    for m in modules:
        spec = arena_pools[m].modules[m]
        page = LoRAPool.page_bytes_for({m: spec}, 2, 1, torch.float32)
        plain[m] = LoRAPool(
            {m: spec}, 2, 64 * page, page_rank=1, max_rank=16, max_adapters=slots, dtype=torch.float32
        )
        for slot, r in ranks.items():
            for pool in (arena_pools[m], plain[m]):
                pool.allocate(r, 0.25, slot=slot)
            a, b = torch.randn(r, spec.in_dim, generator=gen), torch.randn(spec.out_dims[0], r, generator=gen)
            for pool in (arena_pools[m], plain[m]):
                pool.write(slot, 0, m, 0, a, b)
        starts.append(col)
        col += spec.out_dims[0]
    x = torch.randn(10, 64, generator=gen)
    y0 = torch.randn(10, col, generator=gen)
    targets = [(arena_pools[m], m, c0) for m, c0 in zip(modules, starts, strict=True)]
    got = lora_apply_many(y0.clone(), x, targets, 0, meta, backend=backend)
    want = y0.clone()
    for m, c0 in zip(modules, starts, strict=True):
        w = plain[m].modules[m].out_dims[0]
        lora_apply(want[:, c0 : c0 + w], x, plain[m], 0, m, meta, backend="torch")
    assert_close_sums(got, want, terms=64 + 16)  # x @ A^T over hidden, then @ B^T over rank
