"""Sampler semantics: greedy, top-k / top-p masks, temperature, per-request seeds, logprobs."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from loraplane.engine.model.sampler import SamplingMetadata, apply_top_k_top_p, sample  # noqa: E402


def meta(rows: int, temperature=1.0, top_k=0, top_p=1.0, seeds=None, logprobs=None) -> SamplingMetadata:
    temps = torch.full((rows,), float(temperature))
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * rows)]
    return SamplingMetadata(
        temperatures=temps,
        top_ks=torch.full((rows,), top_k, dtype=torch.int64),
        top_ps=torch.full((rows,), float(top_p)),
        all_greedy=temperature == 0,
        any_top_k=top_k > 0,
        any_top_p=top_p < 1.0,
        generators=gens,
        num_logprobs=list(logprobs or [None] * rows),
    )


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    out = sample(logits, meta(4, temperature=0))
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 4


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0]), None)
    assert torch.isfinite(masked[0]).tolist() == [False, True, False, False, True]
    assert torch.equal(masked[1], logits[1])  # k = 0 disables
    assert torch.equal(masked[0, [1, 4]], logits[0, [1, 4]])


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = apply_top_k_top_p(probs.log(), None, torch.tensor([0.75]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]  # 0.5 + 0.3 >= 0.75
    tiny = apply_top_k_top_p(probs.log(), None, torch.tensor([0.01]))
    assert torch.isfinite(tiny[0]).tolist() == [True, False, False, False]  # the top token always stays


def test_sampled_tokens_stay_inside_top_k():
    torch.manual_seed(0)
    logits = torch.randn(64, 100)
    out = sample(logits, meta(64, temperature=1.5, top_k=3), torch.Generator().manual_seed(1))
    top3 = logits.topk(3, dim=-1).indices.tolist()
    assert all(t in allowed for t, allowed in zip(out.token_ids, top3, strict=True))


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[math.log(0.7), math.log(0.2), math.log(0.1)]]).repeat(4000, 1)
    out = sample(logits, meta(4000), torch.Generator().manual_seed(0))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_seeded_rows_are_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)
    alone = [sample(logits, meta(1, seeds=[42])).token_ids[0] for _ in range(2)]
    # the same request inside a bigger batch with other, unseeded rows draws the same token
    batch = torch.cat([torch.randn(3, 1000), logits])
    mixed = sample(batch, meta(4, seeds=[None, None, None, 42]), torch.Generator().manual_seed(9))
    assert alone[0] == alone[1] == mixed.token_ids[3]
    # and the seed's stream advances per step: a generator reused gives a sequence, not one repeated token
    m = meta(1, seeds=[7])
    draws = {sample(torch.zeros(1, 1000), m).token_ids[0] for _ in range(5)}
    assert len(draws) > 1


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(3, 30)
    m = meta(3, temperature=1.0)
    m.temperatures[1] = 0.0
    m.all_greedy = False
    out = sample(logits, m, torch.Generator().manual_seed(0))
    assert out.token_ids[1] == int(logits[1].argmax())


def test_logprobs_sampled_and_top_n():
    logits = torch.randn(2, 40)
    out = sample(logits, meta(2, temperature=0, logprobs=[3, None]))
    ref = logits.log_softmax(-1)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.logprobs[0] == pytest.approx(ref[0].max().item(), abs=1e-6)
    top = ref[0].topk(3)
    assert out.top_logprobs[0] == pytest.approx(
        dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    )
    zero = sample(logits, meta(2, temperature=0, logprobs=[0, 0]))
    assert zero.top_logprobs == [{}, {}] and zero.logprobs[1] == pytest.approx(ref[1].max().item(), abs=1e-6)
