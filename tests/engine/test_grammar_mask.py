"""Structured output in the engine: a grammar's bitmask restricts its own rows only, in mixed batches.

The engine imports no grammar library: a request carries an ``api.Grammar`` whose matchers fill a bitmask and
accept tokens. Here a plain-Python grammar (a set of allowed tokens per output position, then the stop tokens)
checks the mask against its definition, the engine end to end (constrained rows follow their grammar and end
by it; unconstrained rows produce exactly the tokens they produce alone), and a matcher that refuses a token.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from loraplane.engine.core.config import EngineConfig  # noqa: E402
from loraplane.engine.core.llm_engine import LLMEngine  # noqa: E402
from loraplane.engine.core.sequence import SamplingParams, Sequence  # noqa: E402
from loraplane.engine.model.logits import apply_token_bitmask  # noqa: E402
from loraplane.engine.model.sampler import process_logits  # noqa: E402
from loraplane.engine.model.sampling_batch import SamplingBatch  # noqa: E402

V = 64
EOS = 3
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def pack(allowed: set[int], words: int) -> torch.Tensor:
    """The bitmask row [words] int32 of ``allowed`` (bit j of word w: token 32w + j)."""
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[list(allowed)] = 1
    values = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)  # [words] in [0, 2^32)
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


class StepsMatcher:
    def __init__(self, steps: list[set[int]], stops: tuple[int, ...], refuse_at: int | None) -> None:
        self.steps, self.stops, self.refuse_at = steps, stops, refuse_at
        self.pos, self.stopped = 0, False
        self.accepted: list[int] = []

    def allowed(self) -> set[int]:
        return self.steps[self.pos] if self.pos < len(self.steps) else set(self.stops)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = pack(self.allowed(), bitmask.shape[1])

    def accept_token(self, token_id: int) -> bool:
        if self.pos == self.refuse_at or token_id not in self.allowed():
            return False
        self.stopped = self.pos >= len(self.steps)
        self.pos += 1
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return self.stopped or (not self.stops and self.pos >= len(self.steps))


class StepsGrammar:
    """Output position k takes a token of steps[k]; after the last, only a stop token (or nothing: it ends)."""

    def __init__(self, steps: list[set[int]], refuse_at: int | None = None) -> None:
        self.steps, self.refuse_at = steps, refuse_at
        self.matchers: list[StepsMatcher] = []

    def matcher(self, stop_token_ids: tuple[int, ...]) -> StepsMatcher:
        m = StepsMatcher(self.steps, stop_token_ids, self.refuse_at)
        self.matchers.append(m)
        return m


@pytest.mark.parametrize("device", DEVICES)
def test_bitmask_keeps_exactly_the_allowed_tokens_of_its_rows(device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=gen)
    rows = torch.tensor([1, 4])
    allowed = [{0, 31, 32, 63}, set(range(20, 40))]  # bit 31 is the int32 sign bit
    bitmask = torch.stack([pack(a, (V + 31) // 32) for a in allowed])
    got = logits.to(device)
    apply_token_bitmask(got, rows.to(device), bitmask.to(device))
    want = logits.clone()
    for row, keep in zip(rows.tolist(), allowed, strict=True):
        want[row, [t for t in range(V) if t not in keep]] = float("-inf")
    torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_metadata_masks_only_the_constrained_rows(device):
    grammar = StepsGrammar([{7, 9}])
    seqs = [Sequence([1, 2], SamplingParams(temperature=0.0)) for _ in range(3)]
    seqs[1] = Sequence([1, 2], SamplingParams(temperature=0.0, grammar=grammar, logit_bias=((5, 50.0),)))
    seqs[1].matcher = grammar.matcher((EOS,))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    meta = SamplingBatch(V, (EOS,), torch.device(device), 0).metadata(seqs)
    got = process_logits(logits.to(device), meta).cpu()
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [7, 9]  # the bias on 5 does not lift it


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, grammar=StepsGrammar([]))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64
    )
    engine = LLMEngine(config)
    engine.eos_token_ids = frozenset({EOS})
    engine.runner.sampling.eos_token_ids = (EOS,)
    return engine


def test_mixed_batch_constrained_rows_follow_their_grammar_others_unchanged(engine):
    rng = random.Random(2)
    prompts = [[rng.randrange(4, V) for _ in range(rng.randrange(3, 10))] for _ in range(4)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = engine.generate([prompts[0], prompts[2]], [plain, plain])
    steps = [set(rng.sample(range(4, V), 3)) for _ in range(5)]
    greedy_grammar, ended_grammar = StepsGrammar(steps), StepsGrammar(steps[:3])
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, grammar=greedy_grammar)
    self_ending = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, grammar=ended_grammar)
    seqs = [engine.add_request(prompt, p) for prompt, p in zip(prompts, [plain, seeded, plain, self_ending],
                                                                strict=True)]  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == alone
    out = seqs[1].output_token_ids
    assert all(t in allowed for t, allowed in zip(out, steps, strict=False)) and len(out) == 6
    assert out[-1] == EOS and seqs[1].finish_reason == "stop"  # only the stop token was left
    out = seqs[3].output_token_ids  # ignore_eos: no stop token, the grammar ends it
    assert len(out) == 3 and all(t in a for t, a in zip(out, steps, strict=False))
    assert seqs[3].finish_reason == "stop"


def test_a_token_the_matcher_refuses_fails_that_request_alone(engine):
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    bad = SamplingParams(temperature=0.0, max_tokens=6, grammar=StepsGrammar([{10}, {11}], refuse_at=1))
    seqs = [engine.add_request([5, 6, 7], plain), engine.add_request([5, 6, 8], bad)]
    while engine.has_unfinished():
        engine.step()
    assert seqs[0].finish_reason == "length" and len(seqs[0].output_token_ids) == 6
    assert seqs[1].finish_reason == "error" and "grammar" in seqs[1].error
    assert seqs[1].output_token_ids == [10]
