"""End to end on CPU in fp32: the real ModelRunner under the scheduler gives transformers' greedy tokens exactly.

Tiny random Llama (untied) and Qwen2 (qkv bias, tied embeddings) from conftest; 64 greedy steps with no eos stop,
for one request, for a batch of different prompt lengths, with a KV cache so small that sequences get
preempted and recomputed, and with chunked prefill sharing a small token budget with decodes.
"""

from __future__ import annotations

import asyncio
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams  # noqa: E402

STEPS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
PROMPT_LENS = (3, 11, 17, 30)


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENS]


CASES = [
    pytest.param(("llama", "cpu"), id="llama-cpu"),
    pytest.param(("qwen2", "cpu"), id="qwen2-cpu"),
    # On the GPU the decode steps replay CUDA graphs over the paged Triton kernel; still fp32, still exact.
    pytest.param(("llama", "cuda"), id="llama-cuda", marks=pytest.mark.gpu),
    pytest.param(("qwen2", "cuda"), id="qwen2-cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", params=CASES)
def model_and_reference(request, tiny_llama_dir, tiny_qwen2_dir):
    """(model folder, device, prompts, transformers' greedy continuations of each prompt, one at a time)."""
    arch, device = request.param
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None  # exactly STEPS tokens, like ignore_eos
    prompts = make_prompts(hf.config.vocab_size)
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            # An explicit mask: generate() would otherwise mask prompt tokens that equal pad_token_id.
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=STEPS,
                pad_token_id=0,
            )
            refs.append(out[0, len(prompt) :].tolist())
    assert all(len(r) == STEPS for r in refs)
    return (model_dir, device), prompts, refs


def make_engine(model, **overrides) -> LLMEngine:
    model_dir, device = model
    fields = dict(model=str(model_dir), device=device, dtype="float32", block_size=16, num_kv_blocks=64)
    return LLMEngine(EngineConfig(**{**fields, **overrides}))


def test_single_request(model_and_reference):
    model, prompts, refs = model_and_reference
    engine = make_engine(model)
    assert engine.generate([prompts[2]], GREEDY) == [refs[2]]


def test_batch_of_different_prompt_lengths(model_and_reference):
    model, prompts, refs = model_and_reference
    engine = make_engine(model)
    assert engine.generate(prompts, GREEDY) == refs


def test_preemption_keeps_tokens_identical(model_and_reference):
    model, prompts, refs = model_and_reference
    # 12 blocks of 8 = 96 slots; the four sequences grow to 67..94 tokens each, so they cannot all stay resident.
    engine = make_engine(model, block_size=8, num_kv_blocks=12)
    assert engine.generate(prompts, GREEDY) == refs
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("budget", [8, 4])
def test_chunked_prefill_keeps_tokens_identical(model_and_reference, budget):
    model, prompts, refs = model_and_reference
    engine = make_engine(model, max_num_batched_tokens=budget, block_size=4, num_kv_blocks=128)
    batches = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch: batches.append(batch) or execute(batch)
    # Arrivals staggered so later prompts are chunked while earlier ones decode in the same step.
    seqs = [engine.add_request(prompts[0], GREEDY)]
    pending = list(prompts[1:])
    while engine.has_unfinished():
        if pending:
            seqs.append(engine.add_request(pending.pop(0), GREEDY))
        engine.step()
    assert [s.output_token_ids for s in seqs] == refs
    assert all(b.num_tokens <= budget for b in batches)
    mixed = [
        b
        for b in batches
        if any(c.sample and c.start > 0 for c in b.chunks) and not all(c.sample for c in b.chunks)
    ]
    assert mixed, "no step mixed decodes with a prefill chunk"
    if budget == 4:  # three decodes leave one token: a one-token prompt chunk that samples nothing
        assert any(b.is_decode_only and not all(c.sample for c in b.chunks) for b in batches)


def test_seeded_sampling_survives_preemption(model_and_reference):
    """The runner keeps a preempted sequence's generator: recompute must not replay or skip random draws."""
    model, prompts, _ = model_and_reference
    sampling = [
        SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=STEPS, ignore_eos=True)
        for i in range(4)
    ]
    roomy = make_engine(model).generate(prompts, sampling)
    cramped = make_engine(model, block_size=8, num_kv_blocks=12)
    assert cramped.generate(prompts, sampling) == roomy
    assert cramped.num_preemptions > 0


def test_async_stream_text_and_stop_string(model_and_reference, byte_bpe_tokenizer):
    """The whole path: AsyncEngine thread, real runner, incremental detokenizer, stop string.

    A plain test around asyncio.run: the GPU image runs this case and has no pytest-asyncio."""
    from loraplane.engine.core.async_engine import AsyncEngine

    model, prompts, refs = model_and_reference
    tok = byte_bpe_tokenizer
    assert tok.backend_tokenizer.get_vocab_size() > 255  # every id the tiny model emits decodes
    full_text = tok.decode(refs[1], skip_special_tokens=True)
    stop = full_text[20:24]

    async def stream_all() -> list:
        engine = AsyncEngine(LLMEngine(make_engine(model).config, tokenizer=tok))
        try:
            stream = engine.add_request(
                prompts[1], SamplingParams(temperature=0.0, max_tokens=STEPS, stop=(stop,), ignore_eos=True)
            )
            return [out async for out in stream]
        finally:
            await engine.aclose()

    outs = asyncio.run(stream_all())
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == full_text[: full_text.find(stop)]
    assert [t for o in outs for t in o.new_token_ids] == refs[1][: len(outs)]
