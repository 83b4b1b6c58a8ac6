"""Adapters over tensor parallelism on CPU (gloo, 2 processes): S-LoRA's layout, rank 0's residency.

A mixed step of base-only rows and seven kinds of PEFT adapters gives the single-process engine's logits
within fp32 rounding (tests/numerics.py); with a pool of two adapters, evictions and reloads on rank 0 (mirrored on the worker)
keep greedy tokens identical to the single-process engine.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams, Sequence  # noqa: E402
from tests.engine.conftest import TINY_LOGIT_TERMS  # noqa: E402
from tests.engine.peft_adapters import ADAPTER_SPECS, save_peft_adapter  # noqa: E402
from tests.numerics import assert_close_sums  # noqa: E402

pytestmark = pytest.mark.timeout(400)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MIX = [None, "r8", "r16", None, "r64", "rslora", "pattern", "qv", "mlp", "r8", None]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, make_hf_model, tmp_path_factory):
    arch = request.param
    base = make_hf_model(arch, tie_word_embeddings=arch == "qwen2")
    root = tmp_path_factory.mktemp(f"tp-adapters-{arch}")
    folders = {
        name: save_peft_adapter(base, root / name, seed=i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker inherits it
    engines: list[LLMEngine] = []

    def close_parallel() -> None:
        for engine in engines:
            if engine.runner.tp_driver is not None:
                engine.runner.tp_driver.close()

    def make(tp: int, **kw) -> LLMEngine:
        if tp > 1:
            close_parallel()  # one tensor-parallel group per process
        cfg = EngineConfig(model=str(base), device="cpu", block_size=4, max_num_batched_tokens=256,
                           num_kv_blocks=256, tensor_parallel_size=tp, **kw)  # fmt: skip
        engine = LLMEngine(cfg)
        engines.append(engine)
        lora = engine.runner.lora
        for name, folder in folders.items():
            lora.register(name, "v1", folder, f"sha256:{name}", lora.parse(folder))
        return engine

    try:
        yield make
    finally:
        close_parallel()
        torch.set_num_threads(threads)


def key(name):
    return None if name is None else f"{name}@v1"


def run(engine: LLMEngine, requests) -> list[list[int]]:
    seqs = [engine.add_request(p, GREEDY, adapter=key(a)) for p, a in requests]
    while engine.has_unfinished():
        engine.step()
    return [list(s.output_token_ids) for s in seqs]


def test_mixed_adapter_logits_equal_single_process(setup):
    rng = random.Random(1)
    prompts = [rng.choices(range(256), k=9) for _ in MIX]

    def logits(engine, names):
        seqs = [Sequence(p, GREEDY, adapter=key(a)) for p, a in zip(prompts, names, strict=True)]
        for i, seq in enumerate(seqs):
            seq.block_table = [3 * i, 3 * i + 1, 3 * i + 2]
        return engine.runner.forward_logits(ScheduledBatch([ScheduledChunk(s, 0, 9, True) for s in seqs]))

    single, parallel = setup(1), setup(2)
    want, got = logits(single, MIX), logits(parallel, MIX)
    assert_close_sums(got, want, TINY_LOGIT_TERMS)  # the shards sum in another order
    base_only = logits(parallel, [None] * len(MIX))
    for row, name in enumerate(MIX):  # the adapters really act on the TP=2 rows
        changed = (got[row] - base_only[row]).abs().max().item()
        assert (changed > 1e-3) == (name is not None), (name, changed)
    # each rank holds its shard: q_proj's B rows and o_proj's A columns are half of the single process's
    pools, whole = parallel.runner.lora.gpu.pools, single.runner.lora.gpu.pools
    assert pools["q_proj"].modules["q_proj"].out_dims[0] * 2 == whole["q_proj"].modules["q_proj"].out_dims[0]
    assert pools["o_proj"].modules["o_proj"].in_dim * 2 == whole["o_proj"].modules["o_proj"].in_dim
    assert pools["o_proj"].modules["o_proj"].out_dims == whole["o_proj"].modules["o_proj"].out_dims


def test_evictions_on_rank_zero_keep_greedy_tokens(setup):
    rng = random.Random(2)
    requests = [(rng.choices(range(256), k=rng.randint(3, 14)), a) for a in MIX]
    want = run(setup(1), requests)
    small = setup(2, max_loras=2, max_num_seqs=2)
    assert small.runner.warm_adapter("r64@v1") > 0  # a warm-up forward runs on every rank too
    assert run(small, requests) == want
    tiers = small.runner.lora.tier_stats()
    assert tiers["gpu"]["entries"] < len(ADAPTER_SPECS)  # the pool really evicted


@pytest.mark.gpu
def test_gpu_nccl_mixed_adapters_greedy_identical(make_hf_model, tmp_path):
    """2 GPUs, NCCL, decode graphs with the LoRA launches and the all-reduces: a mixed batch of adapters, with
    pools too small for all of them (evictions and reloads broadcast to the worker), gives one GPU's greedy
    tokens."""
    from tests.engine.tp_watch import stacks_after

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    base = make_hf_model("llama", tie_word_embeddings=False)
    folders = {
        name: save_peft_adapter(base, tmp_path / name, seed=i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }

    def engine(tp: int) -> LLMEngine:
        cfg = EngineConfig(model=str(base), device="cuda", dtype="float32", block_size=16, num_kv_blocks=128,
                           max_model_len=128, max_num_seqs=2, max_loras=2, tensor_parallel_size=tp)  # fmt: skip
        e = LLMEngine(cfg)
        for name, folder in folders.items():
            e.runner.lora.register(name, "v1", folder, f"sha256:{name}", e.runner.lora.parse(folder))
        return e

    rng = random.Random(4)
    requests = [(rng.choices(range(256), k=rng.randint(3, 30)), a) for a in MIX]
    with stacks_after(150):
        want = run(engine(1), requests)
        parallel = engine(2)
        try:
            assert parallel.runner.graphs is not None and parallel.runner.base_graphs is not None
            assert run(parallel, requests) == want
            assert parallel.runner.lora.tier_stats()["gpu"]["entries"] < len(ADAPTER_SPECS)  # it evicted
        finally:
            parallel.runner.tp_driver.close()
        assert not torch.distributed.is_initialized()  # the group was left (its graphs went first)
