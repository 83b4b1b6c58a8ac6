"""Prefix caching with real adapters (tiny Llama, PEFT adapters, CPU): KV computed under one adapter version is
never reused under another version of the same name or by the base, and reuse under one version gives the
tokens of a cold run."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams  # noqa: E402
from tests.engine.peft_adapters import save_peft_adapter  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def versions(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-versions")
    spec = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"])
    return {
        version: save_peft_adapter(tiny_llama_dir, root / version, seed=seed, **spec)
        for seed, version in enumerate(["v1", "v2"])
    }


def make_engine(base, versions, caching: bool) -> LLMEngine:
    torch.set_num_threads(1)
    cfg = EngineConfig(model=str(base), device="cpu", block_size=4, max_num_batched_tokens=64,
                       num_kv_blocks=128, enable_prefix_caching=caching)  # fmt: skip
    engine = LLMEngine(cfg)
    lora = engine.runner.lora
    for version, folder in versions.items():
        lora.register("chat", version, folder, f"sha256:chat-{version}", lora.parse(folder))
    return engine


def generate(engine: LLMEngine, prompt: list[int], adapter: str | None) -> list[int]:
    seq = engine.add_request(prompt, GREEDY, adapter=adapter)
    while engine.has_unfinished():
        engine.step()
    return list(seq.output_token_ids)


def test_versions_and_base_share_no_kv_and_reuse_is_exact(tiny_llama_dir, versions):
    prompt = random.Random(3).choices(range(256), k=22)
    order = ["chat@v1", "chat@v2", None]
    cold_engine = make_engine(tiny_llama_dir, versions, caching=False)
    cold = {adapter: generate(cold_engine, prompt, adapter) for adapter in order}
    assert len({tuple(tokens) for tokens in cold.values()}) == 3, "the versions should answer differently"

    engine = make_engine(tiny_llama_dir, versions, caching=True)
    blocks = engine.scheduler.block_manager
    for adapter in order:  # the same prompt, one after the other: every block stays cached meanwhile
        assert generate(engine, prompt, adapter) == cold[adapter]
        assert blocks.prefix_hit_tokens == 0, f"{adapter} started on KV computed under another adapter"
    for adapter in order:  # now each finds its own blocks, and its tokens do not change
        hits = blocks.prefix_hit_tokens
        assert generate(engine, prompt, adapter) == cold[adapter]
        assert blocks.prefix_hit_tokens - hits == 20  # 5 full blocks of 4; the 22nd token is recomputed
