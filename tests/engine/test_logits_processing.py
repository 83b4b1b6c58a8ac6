"""Logit bias, min_tokens, presence / frequency / repetition penalties and min-p, per row, in mixed batches.

Each control is checked three ways: against a plain-torch reference written from its definition (one row at a
time), against transformers' processor of the same name where one exists, and end to end: the engine's greedy
tokens for a batch where every request uses different settings equal transformers' generate() of each alone.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams, Sequence  # noqa: E402
from loraplane.engine.model.logits import apply_min_p  # noqa: E402
from loraplane.engine.model.sampler import process_logits, sample  # noqa: E402
from loraplane.engine.model.sampling_batch import SamplingBatch  # noqa: E402

V = 64
EOS = 3
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

# Every row different: one control each, several at once, and plain rows between them.
ROWS = [
    dict(),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(presence_penalty=-0.5, frequency_penalty=1.0, repetition_penalty=1.3),
    dict(logit_bias=((5, 10.0), (7, -100.0), (5, 2.5))),
    dict(min_tokens=4, stop_token_ids=(9, 11)),
    dict(min_tokens=4, ignore_eos=True),
    dict(min_tokens=4, logit_bias=((EOS, 50.0),), frequency_penalty=0.3),
]


def make_seqs(rng: random.Random) -> list[Sequence]:
    seqs = []
    for fields in ROWS:
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
        seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=32, **fields))
        for _ in range(rng.randrange(0, 8)):
            seq.append_token(rng.randrange(V))
        seqs.append(seq)
    return seqs


def reference(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row, from the definitions (vLLM's order: bias, min_tokens, penalties)."""
    p, row = seq.sampling, logits.clone()
    for token, bias in p.logit_bias:
        row[token] += bias
    if seq.num_output_tokens < p.min_tokens:
        for token in (*p.stop_token_ids, *(() if p.ignore_eos else (EOS,))):
            row[token] = float("-inf")
    for token in range(V):
        count = seq.output_token_ids.count(token)
        if count or token in seq.prompt_token_ids:
            row[token] = (
                row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
            )
        row[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return row


@pytest.mark.parametrize("device", DEVICES)
def test_each_row_matches_its_definition(device):
    rng = random.Random(0)
    seqs = make_seqs(rng)
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(0)) * 3
    meta = SamplingBatch(V, (EOS,), torch.device(device), 0).metadata(seqs)
    got = process_logits(logits.to(device), meta).cpu()
    want = torch.stack([reference(logits[i], seq) for i, seq in enumerate(seqs)])
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, logits) and torch.equal(got[0], logits[0])  # row 0 asks for nothing


def test_rows_match_transformers_processors():
    tf = pytest.importorskip("transformers")
    rng = random.Random(1)
    seqs = make_seqs(rng)
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(1)) * 3
    got = process_logits(logits, SamplingBatch(V, (EOS,), torch.device("cpu"), 0).metadata(seqs))
    checked = 0
    for i, seq in enumerate(seqs):
        p, ids = seq.sampling, torch.tensor([seq.token_ids])
        if set(ROWS[i]) == {"repetition_penalty"}:
            want = tf.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[i : i + 1].clone())
        elif set(ROWS[i]) == {"logit_bias"}:
            biases: dict[tuple[int, ...], float] = {}
            for token, bias in p.logit_bias:
                biases[(token,)] = biases.get((token,), 0.0) + bias
            want = tf.SequenceBiasLogitsProcessor(biases)(ids, logits[i : i + 1].clone())
        elif set(ROWS[i]) == {"min_tokens", "ignore_eos"}:
            continue
        elif set(ROWS[i]) == {"min_tokens", "stop_token_ids"}:
            stop = [EOS, *p.stop_token_ids]
            processor = tf.MinNewTokensLengthLogitsProcessor(seq.num_prompt_tokens, p.min_tokens, stop)
            want = processor(ids, logits[i : i + 1].clone())
        else:
            continue
        torch.testing.assert_close(got[i : i + 1], want)
        checked += 1
    assert checked == 4


def test_min_p_matches_transformers_per_row():
    tf = pytest.importorskip("transformers")
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(2)) * 4
    min_ps = torch.tensor([0.0, 0.05, 0.3, 0.9, 1.0])
    got = apply_min_p(logits, min_ps)
    for i, min_p in enumerate(min_ps.tolist()):
        if min_p == 0.0:
            assert torch.equal(got[i], logits[i])
            continue
        want = tf.MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), logits[i : i + 1].clone())
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want[0])), min_p
    assert torch.isfinite(got[4]).sum() == 1  # min_p = 1 keeps the likeliest token only


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_draws_stay_inside_the_kept_set(device):
    seqs = [
        Sequence([1, 2], SamplingParams(temperature=1.0, min_p=m, seed=i)) for i, m in enumerate([0.0, 0.5])
    ]
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3)) * 3
    batch = SamplingBatch(V, (EOS,), torch.device(device), 0)
    probs = logits.softmax(-1)
    kept = (probs[1] >= 0.5 * probs[1].max()).nonzero().flatten().tolist()
    draws = {sample(logits.to(device), batch.metadata(seqs)).token_ids[1] for _ in range(40)}
    assert draws <= set(kept)


@pytest.mark.parametrize("device", DEVICES)
def test_output_counts_follow_the_sampled_tokens_and_rows_are_reused(device):
    batch = SamplingBatch(V, (EOS,), torch.device(device), 0)
    seqs = [Sequence([1, 2, 2], SamplingParams(temperature=1.0, seed=s, frequency_penalty=f))
            for s, f in ((0, 0.5), (1, 0.0), (2, 1.0))]  # fmt: skip
    for _ in range(6):
        out = sample(torch.randn(3, V, device=device), batch.metadata(seqs))
        for seq, token in zip(seqs, out.token_ids, strict=True):
            seq.append_token(token)
    state = batch.penalties
    for seq in (seqs[0], seqs[2]):
        slot = state.slot_of[seq.seq_id]
        assert (
            state.counts[slot].tolist()
            == torch.bincount(torch.tensor(seq.output_token_ids), minlength=V).tolist()
        )
        assert state.prompt_mask[slot].nonzero().flatten().tolist() == [1, 2]
    assert seqs[1].seq_id not in state.slot_of  # no penalty: no row
    freed = state.slot_of[seqs[0].seq_id]
    batch.release([seqs[0].seq_id])
    newcomer = Sequence([5], SamplingParams(presence_penalty=1.0))
    batch.metadata([newcomer])
    assert state.slot_of[newcomer.seq_id] == freed and state.counts[freed].sum() == 0
    assert state.prompt_mask[freed].nonzero().flatten().tolist() == [5]


class OpenAIPenalties:
    """presence / frequency penalties on the generated tokens, from OpenAI's definition (transformers has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


E2E = [  # (SamplingParams fields, transformers generate() kwargs); greedy, 24 tokens
    (dict(), dict()),
    (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
    (dict(presence_penalty=1.2, frequency_penalty=0.4), "openai"),
    (dict(logit_bias=((17, 3.0), (40, -5.0))), dict(sequence_bias={(17,): 3.0, (40,): -5.0})),
    (dict(min_tokens=6, logit_bias=((EOS, 8.0),)), dict(min_new_tokens=6, sequence_bias={(EOS,): 8.0})),
    (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
]


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def test_mixed_batch_equals_transformers_generate_of_each_alone(transformers, tiny_llama_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(4, V) for _ in range(rng.randrange(3, 12))] for _ in E2E]
    refs = []
    with torch.inference_mode():
        for prompt, (_, kwargs) in zip(prompts, E2E, strict=True):
            ids = torch.tensor([prompt])
            if kwargs == "openai":
                kwargs = dict(
                    logits_processor=transformers.LogitsProcessorList(
                        [OpenAIPenalties(len(prompt), 1.2, 0.4)]
                    )
                )
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                              pad_token_id=0, eos_token_id=EOS, **kwargs)  # fmt: skip
            refs.append(out[0, len(prompt) :].tolist())
    config = EngineConfig(
        model=str(tiny_llama_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64
    )
    engine = LLMEngine(config)
    engine.eos_token_ids = frozenset({EOS})
    engine.runner.sampling.eos_token_ids = (EOS,)
    params = [SamplingParams(temperature=0.0, max_tokens=24, **fields) for fields, _ in E2E]
    got = engine.generate(prompts, params)
    assert got == refs
    assert EOS in got[4] and got[4].index(EOS) >= 6  # min_tokens held the attractive end of sequence back
    assert len({tuple(g) for g in got}) == len(got)
