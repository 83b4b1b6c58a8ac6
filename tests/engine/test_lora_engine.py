"""Multi-LoRA inside the engine, exact against PEFT: a mixed batch of base-only requests and seven kinds of
adapters in one step on tiny Llama and Qwen2 (fp32, CPU); greedy tokens equal each request run alone; a pool
smaller than the working set evicts and reloads mid-run without changing a token."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams, Sequence  # noqa: E402
from tests.engine.peft_adapters import ADAPTER_SPECS, peft_reference, save_peft_adapter  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Row order of the mixed batch: base-only rows between adapter rows, one adapter twice.
MIX = [None, "r8", "r16", None, "r64", "rslora", "pattern", "qv", "mlp", "r8", None]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, make_hf_model, tmp_path_factory):
    arch = request.param
    base = make_hf_model(arch, tie_word_embeddings=arch == "qwen2")
    root = tmp_path_factory.mktemp(f"adapters-{arch}")
    folders = {
        name: save_peft_adapter(base, root / name, seed=i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    return base, folders


def make_engine(base, folders, **kw) -> LLMEngine:
    torch.set_num_threads(1)
    cfg = EngineConfig(model=str(base), device="cpu", block_size=4, max_num_batched_tokens=256,
                       num_kv_blocks=256, **kw)  # fmt: skip
    engine = LLMEngine(cfg)
    lora = engine.runner.lora
    for name, folder in folders.items():
        lora.register(name, "v1", folder, f"sha256:{name}", lora.parse(folder))
    return engine


def key(name):
    return None if name is None else f"{name}@v1"


def test_mixed_batch_logits_match_peft(setup):
    base, folders = setup
    engine = make_engine(base, folders)
    rng = random.Random(1)
    prompts = [rng.choices(range(256), k=9) for _ in MIX]
    seqs = [Sequence(p, GREEDY, adapter=key(a)) for p, a in zip(prompts, MIX, strict=True)]
    for i, seq in enumerate(seqs):
        seq.block_table = [3 * i, 3 * i + 1, 3 * i + 2]
    logits = engine.runner.forward_logits(ScheduledBatch([ScheduledChunk(s, 0, 9, True) for s in seqs]))

    ref_model = peft_reference(base, folders)
    with torch.no_grad():
        ref = ref_model(input_ids=torch.tensor(prompts), adapter_names=[a or "__base__" for a in MIX]).logits[
            :, -1
        ]
        with ref_model.disable_adapter():
            base_only = ref_model(input_ids=torch.tensor(prompts)).logits[:, -1]
    for row, name in enumerate(MIX):
        err = ((logits[row].double() - ref[row].double()).norm() / ref[row].double().norm()).item()
        assert err < 1e-4, (name, err)
        if name is not None:  # the adapter really changed something
            assert not torch.allclose(ref[row], base_only[row], atol=1e-3), name


def run(engine: LLMEngine, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    seqs = [engine.add_request(p, GREEDY, adapter=key(a)) for p, a in requests]
    while engine.has_unfinished():
        engine.step()
    return [list(s.output_token_ids) for s in seqs]


def test_greedy_mixed_equals_each_alone_and_eviction_keeps_tokens(setup):
    base, folders = setup
    rng = random.Random(2)
    requests = [(rng.choices(range(256), k=rng.randint(3, 14)), a) for a in MIX]
    mixed = run(make_engine(base, folders), requests)
    alone_engine = make_engine(base, folders)
    assert mixed == [run(alone_engine, [r])[0] for r in requests]
    # A pool of two max-rank adapters per module, with at most two requests per step: the seven adapters
    # keep evicting each other and reloading from the host tier.
    small = make_engine(base, folders, max_loras=2, max_num_seqs=2)
    assert run(small, requests) == mixed
    tiers = small.runner.lora.tier_stats()
    assert tiers["gpu"]["entries"] < len(folders) and tiers["host"]["entries"] == len(folders)


def test_qv_only_adapter_costs_its_own_bytes_and_no_other_module(setup):
    base, folders = setup
    engine = make_engine(base, folders)
    lora = engine.runner.lora
    lora.ensure_resident(["qv@v1", "r64@v1"])
    slots = lora.gpu.slots["qv@v1"]
    assert sorted(slots) == ["q_proj", "v_proj"]
    on_disk = (folders["qv"] / "adapter_model.safetensors").stat().st_size
    assert abs(lora.gpu.bytes_of["qv@v1"] - on_disk) <= 0.10 * on_disk
    on_disk64 = (folders["r64"] / "adapter_model.safetensors").stat().st_size
    assert abs(lora.gpu.bytes_of["r64@v1"] - on_disk64) <= 0.10 * on_disk64
    # a step of q,v-only tokens builds metadata for q and v only: the other five modules launch nothing
    metas = lora.prepare_step([("qv@v1", 3), (None, 2)], "decode")
    assert {m for m, meta in metas.items() if meta is not None} == {"q_proj", "v_proj"}


# ------------------------------------------------------------------------------------------------------ GPU
def gpu_engine(base, folders, dtype: str, enforce_eager: bool) -> LLMEngine:
    cfg = EngineConfig(model=str(base), device="cuda", dtype=dtype, block_size=16, num_kv_blocks=128,
                       max_num_seqs=16, max_num_batched_tokens=512, enforce_eager=enforce_eager)  # fmt: skip
    engine = LLMEngine(cfg)
    lora = engine.runner.lora
    for name, folder in folders.items():
        lora.register(name, "v1", folder, f"sha256:{name}", lora.parse(folder))
    return engine


@pytest.mark.gpu
def test_gpu_bf16_mixed_batch_close_to_peft(setup):
    """Triton kernels in bf16: each row's logits against PEFT's fp32 mixed batch (bf16 rounding only)."""
    base, folders = setup
    engine = gpu_engine(base, folders, "bfloat16", enforce_eager=True)
    rng = random.Random(3)
    prompts = [rng.choices(range(256), k=9) for _ in MIX]
    seqs = [Sequence(p, GREEDY, adapter=key(a)) for p, a in zip(prompts, MIX, strict=True)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i]
    logits = engine.runner.forward_logits(ScheduledBatch([ScheduledChunk(s, 0, 9, True) for s in seqs])).cpu()
    ref_model = peft_reference(base, folders)
    with torch.no_grad():
        names = [a or "__base__" for a in MIX]
        ref = ref_model(input_ids=torch.tensor(prompts), adapter_names=names).logits[:, -1].double()
        with ref_model.disable_adapter():
            base_ref = ref_model(input_ids=torch.tensor(prompts)).logits[:, -1].double()
    for row, name in enumerate(MIX):
        err = (logits[row].double() - ref[row]).norm().item()
        assert err < 8e-2 * ref[row].norm().item(), (name, err)
        if name is not None:  # bf16 rounding is far below what the adapter itself changes
            assert err < 0.5 * (ref[row] - base_ref[row]).norm().item(), (name, err)


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_with_adapters_equals_eager_and_alone(setup):
    base, folders = setup
    rng = random.Random(4)
    requests = [(rng.choices(range(256), k=rng.randint(3, 14)), a) for a in MIX]
    graphs = gpu_engine(base, folders, "float32", enforce_eager=False)
    assert graphs.runner.graphs is not None
    mixed = run(graphs, requests)
    assert mixed == run(gpu_engine(base, folders, "float32", enforce_eager=True), requests)
    assert mixed == [run(graphs, [r])[0] for r in requests]
    assert mixed == run(make_engine(base, folders), requests)  # and the CPU engine (exact against PEFT)
