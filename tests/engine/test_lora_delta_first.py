"""Delta first: an eager step whose every token has an adapter with a projection's modules writes the delta
into an empty y and lets the base GEMM add itself on top (``LoRALinear._delta_first``). Its logits match
transformers + PEFT and the GEMM-first order; a step with a base-only row, or an adapter without a module,
keeps GEMM first for that projection."""

from __future__ import annotations

import random

import pytest
import torch

from loraplane.engine.core.scheduler import ScheduledBatch, ScheduledChunk
from loraplane.engine.core.sequence import Sequence
from loraplane.engine.lora.layers import LoRALinear
from tests.engine.peft_adapters import peft_reference
from tests.engine.test_lora_engine import GREEDY, key, make_engine, setup  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ALL_MODULES = ["r8", "r16", "r64", "rslora", "r16"]


def _logits(engine, names, prompts, taken: list):
    seqs = [Sequence(p, GREEDY, adapter=key(a)) for p, a in zip(prompts, names, strict=True)]
    for i, seq in enumerate(seqs):
        seq.block_table = [3 * i, 3 * i + 1, 3 * i + 2]
    real = LoRALinear._delta_first

    def spy(self, x, live):
        taken.append((self.slices[0][0], real(self, x, live)))
        return taken[-1][1]

    LoRALinear._delta_first = spy
    try:
        return engine.runner.forward_logits(ScheduledBatch([ScheduledChunk(s, 0, 9, True) for s in seqs]))
    finally:
        LoRALinear._delta_first = real


@pytest.mark.parametrize(
    "names", [ALL_MODULES, [*ALL_MODULES[:2], None], ["r8", "qv"]], ids=["all", "base-row", "qv"]
)
def test_delta_first_matches_peft_and_gemm_first(setup, names):  # noqa: F811
    base, folders = setup
    engine = make_engine(base, folders)
    rng = random.Random(5)
    prompts = [rng.choices(range(256), k=9) for _ in names]
    taken: list = []
    logits = _logits(engine, names, prompts, taken)
    engine.runner.lora_state.delta_first = False
    off: list = []
    gemm_first = _logits(engine, names, prompts, off)
    assert not any(t for _, t in off)
    ref_model = peft_reference(base, folders)
    with torch.no_grad():
        ref = ref_model(
            input_ids=torch.tensor(prompts), adapter_names=[a or "__base__" for a in names]
        ).logits[:, -1]
    for row in range(len(names)):
        err = ((logits[row].double() - ref[row].double()).norm() / ref[row].double().norm()).item()
        assert err < 1e-4, (names[row], err)
    torch.testing.assert_close(logits, gemm_first, rtol=1e-4, atol=1e-4)
    by_module: dict[str, set] = {}
    for first_module, t in taken:
        by_module.setdefault(first_module, set()).add(t)
    if names == ALL_MODULES:
        # every bias-free projection stores (qwen2's q, k, v carry a bias: GEMM first there)
        biased = engine.runner.model.model.layers[0].self_attn.qkv_proj.base_layer.bias is not None
        assert by_module["o_proj"] == by_module["gate_proj"] == by_module["down_proj"] == {True}
        assert by_module["q_proj"] == {not biased}
    elif None in names:
        assert all(not t for _, t in taken)
    else:  # qv has q, v but no k, no o, no MLP: only those projections whose every module both adapters have
        assert by_module["q_proj"] == {False} and by_module["gate_proj"] == {False}
