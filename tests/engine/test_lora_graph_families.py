"""Decode graph families keyed by the modules a step's adapters have (EngineConfig.lora_graph_module_sets).

CPU, fp32: the picker takes the smallest captured module set that covers the step's modules (else the
all-module graphs); the LoRA launches a family holds give the same logits as every module's launches for
any step it is picked for, bit for bit, and leaving out a used module would change them; the config is
checked. GPU: graphs of families switching from step to step (q,v-only, all-module, partial, q,v-only
again) give the eager engine's greedy tokens, and each family served steps.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from loraplane.engine.core.config import ATTENTION_MODULE_SETS, PEFT_MODULES, EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams  # noqa: E402
from loraplane.engine.lora.weights import TARGET_MODULES  # noqa: E402
from loraplane.engine.model.attention import AttentionMetadata, PrefillSpan  # noqa: E402
from loraplane.engine.model.cuda_graphs import lora_module_family  # noqa: E402
from loraplane.engine.model.fused_ops import set_model_pdl  # noqa: E402
from loraplane.kernels import LoRABatchMeta, overlap, triton_apply  # noqa: E402
from loraplane.kernels.launch_config import capture_policy, set_capture_policy  # noqa: E402
from tests.engine.peft_adapters import ADAPTER_SPECS, save_peft_adapter  # noqa: E402

NAMES = ("r16", "qv", "pattern", "mlp")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
QV, ATTN = frozenset({"q_proj", "v_proj"}), frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(make_hf_model, tmp_path_factory):
    base = make_hf_model("llama")
    root = tmp_path_factory.mktemp("families")
    folders = {n: save_peft_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(NAMES)}
    return base, folders


def make_engine(base, folders, device: str = "cpu", **kw) -> LLMEngine:
    opts = dict(block_size=4, max_num_batched_tokens=256, num_kv_blocks=256,
                lora_graph_module_sets=ATTENTION_MODULE_SETS)  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(base), device=device, **{**opts, **kw}))
    lora = engine.runner.lora
    for name, folder in folders.items():
        lora.register(name, "v1", folder, f"sha256:{name}", lora.parse(folder))
    return engine


def test_module_family_is_the_smallest_cover():
    families = [QV, ATTN]
    assert lora_module_family({"q_proj"}, families) == QV
    assert lora_module_family({"q_proj", "v_proj"}, families) == QV
    assert lora_module_family({"k_proj"}, families) == ATTN
    assert lora_module_family({"q_proj", "o_proj"}, families) == ATTN
    assert lora_module_family({"q_proj", "down_proj"}, families) is None  # the all-module graphs
    assert lora_module_family(set(), families) == QV
    assert lora_module_family({"q_proj"}, []) is None


def test_module_sets_are_checked():
    assert PEFT_MODULES == TARGET_MODULES
    cfg = EngineConfig(model="m", lora_graph_module_sets=[["q_proj", "v_proj"]])
    assert cfg.lora_graph_module_sets == (("q_proj", "v_proj"),)
    for bad in (("q_proj", "v_proj"), (("q_proj", "qq"),), ((),), "q_proj"):
        with pytest.raises(ValueError, match="EngineConfig.lora_graph_module_sets"):
            EngineConfig(model="m", lora_graph_module_sets=bad)


@pytest.mark.parametrize("mix", [("qv", None, "qv"), ("pattern", "qv"), ("mlp",), ("r16", "qv", None)])
def test_family_launches_equal_every_module_launches(setup, mix):
    """A step's logits with the picked family's LoRA launches (captured-style metadata on only its modules)
    equal those with every module's launches, bit for bit; a family missing a used module would not."""
    base, folders = setup
    runner = make_engine(base, folders).runner
    lora, n = runner.lora, 4
    keys = [None if a is None else f"{a}@v1" for a in mix]
    lora.prepare_step([(k, n) for k in keys], "decode")  # makes them resident, records the step's modules
    used = lora.step_modules
    assert used == {m for k in keys if k for m in lora.gpu.slots[k]}
    family = lora_module_family(used, [frozenset(s) for s in runner.config.lora_graph_module_sets])
    T = n * len(mix)
    meta = LoRABatchMeta(T, "cpu", capture=True, max_rank=64).build(
        [(-1 if k is None else lora.gpu.slot_id[k], n) for k in keys], lora.gpu.ranks
    )
    ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(len(mix)))
    attn = AttentionMetadata(slot_mapping=torch.full((T,), -1), prefill=[PrefillSpan(0, T, T, -1)])

    def logits(modules) -> torch.Tensor:
        runner.lora_state.metas = {m: meta if m in modules else None for m in lora.gpu.pools}
        with torch.inference_mode():
            return runner.model(ids, torch.arange(T), attn, torch.arange(T))

    every = logits(set(lora.gpu.pools))
    assert torch.equal(logits(family or set(lora.gpu.pools)), every), family
    assert not torch.allclose(logits(used - {sorted(used)[0]}), every, atol=1e-4)  # the check can fail


def run_phases(engine: LLMEngine, phases) -> list[list[int]]:
    """Each phase's requests run to the end before the next starts, so its decode steps use only its
    adapters (and so one family)."""
    out = []
    for requests in phases:
        seqs = [engine.add_request(p, GREEDY, adapter=a) for p, a in requests]
        while engine.has_unfinished():
            engine.step()
        out += [list(s.output_token_ids) for s in seqs]
    return out


def switching_phases() -> list[list[tuple[list[int], str | None]]]:
    """Requests whose steps need the q,v family, then all modules, then a partial set, q,v again, MLP."""
    rng = random.Random(5)

    def reqs(*adapters):
        return [
            (rng.choices(range(256), k=rng.randint(3, 9)), None if a is None else f"{a}@v1") for a in adapters
        ]

    return [
        reqs("qv", None, "qv"),
        reqs("r16", "qv", None),
        reqs("pattern", "qv"),
        reqs("qv", "qv"),
        reqs("mlp"),
    ]


@pytest.mark.gpu
def test_gpu_switching_families_equal_eager(setup):
    base, folders = setup
    phases = switching_phases()
    cfg = dict(block_size=16, max_num_seqs=8, dtype="float32")
    graphs = make_engine(base, folders, device="cuda", **cfg)
    runner = graphs.runner
    assert set(runner.module_graphs) == {QV, ATTN}
    out = run_phases(graphs, phases)
    assert runner.module_graphs[QV].replays > 0 and runner.graphs.replays > 0  # both served steps
    assert runner.module_graphs[ATTN].replays == 0  # nothing here needs it: pattern also has down_proj
    eager = make_engine(base, folders, device="cuda", enforce_eager=True, **cfg)
    assert out == run_phases(eager, phases)
    assert out == run_phases(make_engine(base, folders), phases)  # and the CPU engine
    none = make_engine(base, folders, device="cuda", lora_graph_module_sets=(), **cfg)
    assert none.runner.module_graphs == {} and out == run_phases(none, phases)


@pytest.mark.gpu
def test_gpu_pdl_graphs_equal_eager(setup):
    """Captured decode with programmatic dependent launch, for the LoRA kernels (``CapturePolicy(pdl=True)``)
    beside the base GEMMs and the shrink's side stream, and for the decoder's own kernels
    (``set_model_pdl``): the eager engine's greedy tokens."""
    old_model = set_model_pdl(True)
    try:
        _graphs_equal_eager(setup, pdl=True)
    finally:
        set_model_pdl(old_model)


@pytest.mark.gpu
def test_gpu_expand_beside_graphs_equal_eager(setup, monkeypatch):
    """Captured decode with each projection's whole LoRA pair beside its base GEMM, the delta added after
    the join (``CapturePolicy(expand_beside=1)``): the eager engine's greedy tokens (float32)."""
    calls = []

    def counted(*args):
        calls.append(1)
        return overlap.lora_beside(*args)

    monkeypatch.setattr(triton_apply, "lora_beside", counted)
    _graphs_equal_eager(setup, expand_beside=1)
    assert calls  # the captures went through it


def _graphs_equal_eager(setup, **policy) -> None:
    """The switching phases' greedy tokens from CUDA graphs captured under ``policy`` (CapturePolicy
    fields) equal the eager engine's."""
    base, folders = setup
    phases = switching_phases()
    cfg = dict(block_size=16, max_num_seqs=8, dtype="float32")
    old = set_capture_policy(**{**dataclasses.asdict(capture_policy()), **policy})
    try:
        out = run_phases(make_engine(base, folders, device="cuda", **cfg), phases)
    finally:
        set_capture_policy(**dataclasses.asdict(old))
    assert out == run_phases(make_engine(base, folders, device="cuda", enforce_eager=True, **cfg), phases)
