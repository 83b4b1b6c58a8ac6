"""The LoRA kernel warm-up at engine start: its plan reaches every launch shape a step can pick (checked
against ``pick_config`` over random batches), it touches no adapter's weights or outputs, and on a GPU no
step with adapters compiles a kernel after it."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams, Sequence  # noqa: E402
from loraplane.engine.model.lora_warmup import (  # noqa: E402
    max_tiles,
    module_sets,
    rank_classes,
    requests_for_tiles,
    tile_counts,
    warm_lora_kernels,
    warm_plan,
)
from loraplane.kernels import launch_config  # noqa: E402
from loraplane.kernels.compiles import triton_compiled  # noqa: E402
from loraplane.kernels.launch_config import pick_config  # noqa: E402
from loraplane.kernels.metadata import LoRABatchMeta  # noqa: E402
from tests.engine.peft_adapters import ADAPTER_SPECS, save_peft_adapter  # noqa: E402

# Llama-3-8B's LoRA projections, a pooled q,v pair, and Qwen2-0.5B's. (Widths that are not multiples of 16
# come from masked tensor-parallel shards, whose engines do not warm.)
SHAPES = [(4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,)),
          (4096, (4096, 1024)), (896, (896, 128, 128)), (896, (4864, 4864)), (4864, (896,))]  # fmt: skip
KINDS = {"prefill": (2048, 64), "decode": (256, 16)}  # kind -> (token capacity, tile_m)


def configs_of(kind: str, meta: LoRABatchMeta) -> set:
    """What compiles: each projection's launch shape (each shape's launches compile on their own)."""
    return {(kind, i, pick_config(meta, k, dims, torch.bfloat16)) for i, (k, dims) in enumerate(SHAPES)}


def test_rank_classes_and_tile_counts():
    assert rank_classes(8) == [8]
    assert rank_classes(16) == [16]
    assert rank_classes(48) == [16, 32, 48]
    assert rank_classes(128) == [16, 32, 64]
    assert tile_counts(1) == [1]
    assert tile_counts(12) == [1, 2, 4, 8, 12]
    assert tile_counts(16) == [1, 2, 4, 8, 16]
    assert tile_counts(40) == [1, 2, 4, 8, 16, 17, 32, 40]


def test_module_sets_add_each_configured_family_once():
    pools = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 0, "up_proj": 0}
    sets = module_sets(
        pools, (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("v_proj", "q_proj"))
    )
    assert sets == [
        None,
        frozenset({"q_proj", "v_proj"}),
        frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}),
    ]
    assert module_sets({"q_proj": 0, "v_proj": 0}, (("q_proj", "v_proj"),)) == [None]  # the same as all


@pytest.mark.parametrize("tiles", [1, 2, 5, 9, 15])
def test_requests_for_tiles_make_exactly_that_many_tiles(tiles):
    meta = LoRABatchMeta(512, torch.device("cpu"), tile_m=64)
    reqs = requests_for_tiles(tiles, 64, list(range(8)), 512)
    assert reqs, tiles
    assert meta.build(reqs, [16] * 8).host_num_tiles == tiles
    assert max_tiles(512, 64, 8) == 15  # 7 one-token groups, then 505 tokens in 8 tiles
    assert requests_for_tiles(16, 64, list(range(8)), 512) == []


@pytest.mark.parametrize("max_rank", [16, 64, 128])
def test_plan_reaches_every_launch_shape_a_step_can_pick(max_rank, monkeypatch):
    monkeypatch.setattr(launch_config, "_num_sms", lambda device: 132)  # the H200's: shapes change late
    slots = 160
    free = list(range(slots))
    warmed = set()
    for kind, rank, reqs in warm_plan(max_rank, KINDS, free, sms=132):
        capacity, tile_m = KINDS[kind]
        ranks = [0] * slots
        for s, _ in reqs:
            ranks[s] = rank
        meta = LoRABatchMeta(capacity, torch.device("cpu"), tile_m=tile_m).build(reqs, ranks)
        warmed |= configs_of(kind, meta)
    rng = random.Random(max_rank)
    for trial in range(600):
        kind = rng.choice(list(KINDS))
        capacity, tile_m = KINDS[kind]
        ranks = [rng.randint(1, max_rank) for _ in range(slots)]
        reqs, left = [], capacity
        sizes = rng.choice([[1], [1, 1, 2, 7, 16, 63, 64, 65, 200], [64, 300, 1000]])
        for slot in rng.sample(range(slots), rng.randint(1, slots)):
            n = min(left, rng.choice(sizes))
            if n <= 0:
                break
            reqs.append((slot, n))
            left -= n
        meta = LoRABatchMeta(capacity, torch.device("cpu"), tile_m=tile_m).build(reqs, ranks)
        missed = configs_of(kind, meta) - warmed
        assert not missed, (trial, kind, meta.host_num_tiles, meta.host_max_rank, missed)


def _engine(base, folder, **kw) -> LLMEngine:
    torch.set_num_threads(1)
    cfg = EngineConfig(model=str(base), device=kw.pop("device", "cpu"), block_size=4, max_num_batched_tokens=128,
                       num_kv_blocks=128, max_num_seqs=8, **kw)  # fmt: skip
    engine = LLMEngine(cfg)
    lora = engine.runner.lora
    lora.register("r16", "v1", folder, "sha256:r16", lora.parse(folder))
    return engine


def _logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=1), adapter="r16@v1")
    seq.block_table = [0, 1, 2]
    return engine.runner.forward_logits(ScheduledBatch([ScheduledChunk(seq, 0, len(prompt), True)])).cpu()


def test_warmup_touches_no_adapter(make_hf_model, tmp_path):
    base = make_hf_model("llama")
    folder = save_peft_adapter(base, tmp_path / "r16", seed=1, **ADAPTER_SPECS["r16"])
    engine = _engine(base, folder, max_model_len=24)  # steps of 128 tokens: positions must wrap at 24
    runner, lora = engine.runner, engine.runner.lora
    lora.ensure_resident(["r16@v1"])
    before = _logits(engine, [5, 6, 7, 8, 9])
    pools = {m: (p.ranks.clone(), p.scales.clone(), p.page_table.clone()) for m, p in lora.gpu.pools.items()}
    host_ranks = list(lora.gpu.ranks)
    ran = warm_lora_kernels(runner, ("prefill", "decode"))
    assert ran > 0
    assert lora.gpu.ranks == host_ranks
    for m, p in lora.gpu.pools.items():
        for old, new in zip(pools[m], (p.ranks, p.scales, p.page_table), strict=True):
            assert torch.equal(old, new), m
    assert all(meta is None for meta in runner.lora_state.metas.values())
    assert not runner.lora_state.force_store
    assert torch.equal(_logits(engine, [5, 6, 7, 8, 9]), before)


@pytest.mark.gpu
def test_gpu_no_compile_in_steps_after_warmup(make_hf_model, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    base = make_hf_model("llama")
    root = tmp_path / "adapters"
    names = ["r8", "r16", "r64", "qv", "mlp"]
    cfg = EngineConfig(model=str(base), device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=256,
                       max_num_seqs=16, max_num_batched_tokens=512)  # fmt: skip
    engine = LLMEngine(cfg)
    lora = engine.runner.lora
    for i, name in enumerate(names):
        folder = save_peft_adapter(base, root / name, seed=i, **ADAPTER_SPECS[name])
        lora.register(name, "v1", folder, f"sha256:{name}", lora.parse(folder))
    compiled = triton_compiled()
    assert compiled > 0  # the counter sees the warm-up's compilations, so the check below can fail
    rng = random.Random(0)
    for _ in range(12):  # prefill steps of every size class, one or several adapters
        picks = rng.sample(names, rng.randint(1, 3))
        seqs = []
        for i, a in enumerate(picks):
            n = rng.choice([3, 17, 64, 150])
            seq = Sequence(rng.choices(range(200), k=n), SamplingParams(max_tokens=1), adapter=f"{a}@v1")
            seq.block_table = list(range(16 * i, 16 * i + 10))
            seqs.append(seq)
        engine.runner.forward_logits(
            ScheduledBatch([ScheduledChunk(s, 0, len(s.token_ids), True) for s in seqs])
        )
    torch.cuda.synchronize()
    assert triton_compiled() == compiled


def test_compile_ahead_lists_then_compiles_and_logs_a_failure(monkeypatch, caplog):
    """``compile_ahead``: the forwards run once with launches only listed, each listed shape compiles once
    (Triton's ``warmup``), nothing launches; one thread: nothing ahead, the forwards do not run; a compile
    that fails is logged, not raised, and Triton's asynchronous mode is left off."""
    from triton.runtime import _async_compile

    from loraplane.engine.model.lora_warmup import compile_ahead
    from tests.kernels.test_plans import _FakeJit, _fast

    fn = _FakeJit()
    launch = _fast(monkeypatch, fn)
    x = torch.zeros(16)
    runs = []

    def forwards():
        runs.append(1)
        launch(x, 64, x)
        launch(x, 64, x)

    assert compile_ahead(forwards, threads=1) == 0 and runs == []
    assert compile_ahead(forwards, threads=2) == 1
    assert runs == [1] and fn.bindings == 1 and fn.kernel.calls == []

    def broken(*args, grid, **kw):
        raise RuntimeError("ptxas fatal")

    monkeypatch.setattr(fn, "warmup", broken)
    assert compile_ahead(forwards, threads=2) == 0
    assert "ptxas fatal" in caplog.text
    assert _async_compile.active_mode.get() is None
