"""The dominant adapter merged into a copy of the weights (engine/lora/merge.py) and the decode graph families.

CPU, fp32: a merged step matches PEFT within 1e-4 for full, partial (q,v-only) and rank_pattern adapters;
greedy tokens of a run that merges, unmerges and merges again equal an unmerged run's; the base weights stay
bit-identical; the hysteresis merges after N steps alone and unmerges below the stay share. The family
picker sends base-only steps to the graphs without LoRA launches, and both families compute the same
thing for them. GPU: graphs on merged weights equal the eager merged path and stay close to PEFT.
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
from loraplane.engine.lora.merge import MergePolicy, projection_weights  # noqa: E402
from loraplane.engine.model.attention import AttentionMetadata, PrefillSpan  # noqa: E402
from loraplane.engine.model.cuda_graphs import graph_family  # noqa: E402
from loraplane.kernels import LoRABatchMeta  # noqa: E402
from tests.engine.peft_adapters import ADAPTER_SPECS, peft_reference, save_peft_adapter  # noqa: E402

NAMES = ("r16", "qv", "pattern")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, make_hf_model, tmp_path_factory):
    arch = request.param
    base = make_hf_model(arch, tie_word_embeddings=arch == "qwen2")
    root = tmp_path_factory.mktemp(f"merge-{arch}")
    folders = {n: save_peft_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(NAMES)}
    return base, folders


def make_engine(base, folders, device: str = "cpu", **kw) -> LLMEngine:
    opts = dict(block_size=4, max_num_batched_tokens=256, num_kv_blocks=256)
    cfg = EngineConfig(model=str(base), device=device, **{**opts, **kw})
    engine = LLMEngine(cfg)
    lora = engine.runner.lora
    for name, folder in folders.items():
        lora.register(name, "v1", folder, f"sha256:{name}", lora.parse(folder))
    return engine


def prefill_batch(prompts, adapters) -> ScheduledBatch:
    seqs = [Sequence(p, GREEDY, adapter=a) for p, a in zip(prompts, adapters, strict=True)]
    for i, seq in enumerate(seqs):
        seq.block_table = [4 * i + j for j in range(4)]
    return ScheduledBatch([ScheduledChunk(s, 0, len(s.token_ids), True) for s in seqs])


# ---------------------------------------------------------------------------------------- graph families
def test_graph_family_picks_base_merged_or_lora():
    captured = ("base", "merged")
    assert graph_family([None, None], False, captured) == "base"
    assert graph_family(["a@v1", None], False, captured) == "lora"
    assert graph_family(["a@v1", "a@v1"], True, captured) == "merged"
    assert graph_family([None], False, ()) == "lora"  # nothing else captured: the LoRA graphs serve all
    assert graph_family(["a@v1"], True, ("base",)) == "lora"


def test_base_only_step_equal_with_and_without_lora_launches(setup):
    """What the two decode graph families compute for a base-only step: the LoRA family's launches over
    empty metadata (every module) change nothing, bit for bit."""
    base, folders = setup
    runner = make_engine(base, folders).runner
    runner.lora.ensure_resident(["r16@v1"])
    ids = torch.tensor([3, 17, 42, 7, 99])
    meta = AttentionMetadata(slot_mapping=torch.full((5,), -1), prefill=[PrefillSpan(0, 5, 5, -1)])
    with torch.inference_mode():
        runner.lora_state.metas = dict.fromkeys(runner.lora_state.pools)
        plain = runner.model(ids, torch.arange(5), meta, torch.arange(5))
        graph_meta = LoRABatchMeta(8, "cpu", capture=True, max_rank=64).build(
            [(-1, 5)], runner.lora.gpu.ranks
        )
        runner.lora_state.metas = dict.fromkeys(runner.lora_state.pools, graph_meta)  # as captured
        with_launches = runner.model(ids, torch.arange(5), meta, torch.arange(5))
    assert torch.equal(plain, with_launches)


# ------------------------------------------------------------------------------------------------ merging
@pytest.mark.parametrize("name", NAMES)
def test_merged_step_matches_peft(setup, name):
    base, folders = setup
    engine = make_engine(base, folders, lora_merge=True)
    runner = engine.runner
    runner.merger.merge(f"{name}@v1")
    rng = random.Random(5)
    prompts = [rng.choices(range(256), k=9) for _ in range(3)]
    before = runner.merger.stats["merged_steps"]
    logits = runner.forward_logits(prefill_batch(prompts, [f"{name}@v1"] * 3))
    assert runner.merger.stats["merged_steps"] == before + 1  # served from the merged weights
    ref_model = peft_reference(base, {name: folders[name]})
    with torch.no_grad():
        ref = ref_model(input_ids=torch.tensor(prompts)).logits[:, -1]
        with ref_model.disable_adapter():
            base_only = ref_model(input_ids=torch.tensor(prompts)).logits[:, -1]
    for row in range(3):
        err = ((logits[row].double() - ref[row].double()).norm() / ref[row].double().norm()).item()
        assert err < 1e-4, (name, row, err)
        assert not torch.allclose(ref[row], base_only[row], atol=1e-3)  # the adapter changed something


def run_phases(engine: LLMEngine, phases) -> list[list[int]]:
    """Add each phase's (prompt, adapter, max_tokens) requests, then step ``steps`` times (the last phase:
    to the end). Greedy tokens of every request, in order."""
    seqs = []
    for i, (requests, steps) in enumerate(phases):
        for prompt, adapter, n in requests:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            seqs.append(engine.add_request(prompt, params, adapter=adapter))
        for _ in range(steps if i < len(phases) - 1 else 10_000):
            if not engine.has_unfinished():
                break
            engine.step()
    return [list(s.output_token_ids) for s in seqs]


def test_greedy_tokens_across_merge_switches_equal_unmerged_and_base_untouched(setup):
    base, folders = setup
    rng = random.Random(6)

    def req(adapter, n):
        return rng.choices(range(256), k=rng.randint(3, 8)), adapter, n

    # r16 alone (merged after 2 steps); short base-only and qv requests join (unmerged); r16 alone again
    # (merged again, free: the merged weights still hold it); then qv requests (unmerged), which outlive
    # the r16 ones and get merged over them.
    phases = [
        ([req("r16@v1", 24) for _ in range(3)], 5),
        ([req(None, 4), req("qv@v1", 4)], 8),
        ([req("qv@v1", 20) for _ in range(2)], 0),
    ]
    merged_engine = make_engine(base, folders, lora_merge=True, lora_merge_after_steps=2)
    runner = merged_engine.runner
    before = {k: w.clone() for k, w in projection_weights(runner.model).items()}
    merged = run_phases(merged_engine, phases)
    assert merged == run_phases(make_engine(base, folders), phases)
    stats = runner.merger.stats
    assert stats["merges"] == 2 and stats["unmerges"] >= 2 and stats["merged_steps"] >= 8, stats
    after = projection_weights(runner.model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base weights, bit for bit


def test_hysteresis_merges_after_n_steps_alone_and_unmerges_below_stay_share(setup):
    base, folders = setup
    merger = make_engine(base, folders, lora_merge=True, lora_merge_after_steps=3).runner.merger
    a, b = "r16@v1", "qv@v1"
    assert [merger.begin_step([(a, 4)]) for _ in range(3)] == [False, False, True]
    assert merger.active == a and merger.stats["merges"] == 1
    assert merger.begin_step([(a, 6), (b, 4)]) is False  # 60%: stays merged, the step runs unmerged
    assert merger.active == a
    assert merger.begin_step([(a, 4)]) is True
    assert merger.begin_step([(a, 5), (None, 5)]) is False and merger.active is None  # 50% < 56%
    assert [merger.begin_step([(b, 2)]) for _ in range(3)] == [False, False, True]
    assert merger.active == b and merger.stats["merges"] == 2
    assert [merger.begin_step([(a, 2)]) for _ in range(3)] == [False, False, True]
    assert merger.stats["merges"] == 3  # b overwrote a's merged weights: a is written again


def test_merge_config_is_checked():
    with pytest.raises(ValueError, match="lora_merge_stay_share"):
        EngineConfig(model="m", lora_merge_stay_share=1.5)
    with pytest.raises(ValueError, match="lora_merge:"):
        EngineConfig(model="m", lora_merge=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="lora_merge_after_steps"):
        EngineConfig(model="m", lora_merge_after_steps=0)
    with pytest.raises(ValueError, match="stay_share"):
        MergePolicy(stay_share=0.0)


# ------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_merged_graphs_equal_eager_merged_and_close_to_peft(setup):
    base, folders = setup
    cfg = dict(block_size=16, max_num_seqs=8, lora_merge=True, lora_merge_after_steps=2)
    graphs = make_engine(base, folders, device="cuda", dtype="float32", **cfg)
    eager = make_engine(base, folders, device="cuda", dtype="float32", enforce_eager=True, **cfg)
    assert graphs.runner.merged_graphs is not None
    rng = random.Random(7)
    phases = [([(rng.choices(range(256), k=6), "r16@v1", 12) for _ in range(4)], 3),
              ([(rng.choices(range(256), k=5), None, 4)], 0)]  # fmt: skip
    out = run_phases(graphs, phases)
    assert graphs.runner.merger.stats["merged_steps"] >= 5
    assert out == run_phases(eager, phases) == run_phases(make_engine(base, folders), phases)
    bf16 = make_engine(base, folders, device="cuda", dtype="bfloat16", **cfg).runner
    bf16.merger.merge("r16@v1")
    prompts = [rng.choices(range(256), k=9) for _ in range(2)]
    logits = bf16.forward_logits(prefill_batch(prompts, ["r16@v1"] * 2)).cpu().double()
    ref_model = peft_reference(base, {"r16": folders["r16"]})
    with torch.no_grad():
        ref = ref_model(input_ids=torch.tensor(prompts)).logits[:, -1].double()
        with ref_model.disable_adapter():
            base_ref = ref_model(input_ids=torch.tensor(prompts)).logits[:, -1].double()
    for row in range(2):
        err = (logits[row] - ref[row]).norm().item()
        assert err < 0.5 * (ref[row] - base_ref[row]).norm().item(), err
