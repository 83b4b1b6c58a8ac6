"""Automatic prefix caching: full KV blocks keyed by (parent hash, the adapter's digest, tokens), shared through
refcounts, reused in LRU order; outputs equal a cold run, and nothing is shared across adapter versions."""

from __future__ import annotations

import random

import pytest

from loraplane.engine.core.block_manager import BlockManager
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.sequence import SamplingParams, Sequence


def computed(bm: BlockManager, seq: Sequence, salt: str = "") -> Sequence:
    """Admit seq on its cached prefix, then compute (and register) everything else."""
    seq.cache_salt = salt
    hits = bm.lookup(seq)
    assert bm.can_admit(seq, hits, seq.num_tokens, keep_watermark=False)
    bm.claim(seq, hits)
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return seq


def test_full_blocks_are_shared_and_the_last_token_is_always_computed():
    bm = BlockManager(16, 4, watermark=0.0, enable_prefix_caching=True)
    first = computed(bm, Sequence(list(range(10))))  # blocks [0-3] [4-7] cached, [8-9] partial
    assert bm.num_cached_blocks == 2
    second = Sequence(list(range(10)) + [42])
    assert bm.lookup(second) == first.block_table[:2]
    exact = Sequence(list(range(8)))  # 8 tokens = 2 full blocks, but the 8th token must be recomputed
    assert bm.lookup(exact) == first.block_table[:1]
    computed(bm, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert [bm.ref_counts[b] for b in second.block_table[:2]] == [2, 2]
    assert bm.prefix_hit_tokens == 8 and bm.prefix_queried_tokens == 10 + 11
    bm.free(first)
    bm.free(second)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2  # freed blocks keep their content


def test_the_salt_and_every_earlier_token_are_part_of_the_key():
    bm = BlockManager(32, 4, watermark=0.0, enable_prefix_caching=True)
    computed(bm, Sequence(list(range(12))), salt="sha256:v1")
    assert bm.lookup(_salted(list(range(12)), "sha256:v2")) == []
    assert bm.lookup(_salted(list(range(12)), "")) == []
    assert len(bm.lookup(_salted(list(range(12)), "sha256:v1"))) == 2
    changed_first_block = [99] + list(range(1, 12))  # blocks 2 and 3 hold the same tokens, another prefix
    assert bm.lookup(_salted(changed_first_block, "sha256:v1")) == []


def _salted(tokens: list[int], salt: str) -> Sequence:
    seq = Sequence(tokens)
    seq.cache_salt = salt
    return seq


def test_unreferenced_cached_blocks_are_reused_least_recently_freed_first():
    bm = BlockManager(6, 2, watermark=0.0, enable_prefix_caching=True)
    old = computed(bm, Sequence([1, 2, 3, 4, 5]))  # caches [1,2] [3,4]; [5] partial
    new = computed(bm, Sequence([7, 8, 9, 10, 11]))  # caches [7,8] [9,10]
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    # 2 empty blocks go first, then old's tail, then old's head: the newest content survives longest
    computed(bm, Sequence([20, 21, 22, 23, 24, 25, 26]))
    assert bm.lookup(Sequence([1, 2, 3, 4, 5])) == [], "old's blocks should have been evicted"
    assert len(bm.lookup(Sequence([7, 8, 9, 10, 11]))) == 2


def test_a_free_cached_block_is_revived_rather_than_evicted():
    bm = BlockManager(4, 2, watermark=0.0, enable_prefix_caching=True)
    first = computed(bm, Sequence([1, 2, 3, 4, 5]))
    bm.free(first)
    again = Sequence([1, 2, 3, 4, 6])
    hits = bm.lookup(again)
    assert len(hits) == 2 and bm.can_admit(again, hits, 5, keep_watermark=False)
    assert not bm.can_admit(again, hits, 9, keep_watermark=False)  # 2 revived + 3 new > 4 free
    bm.claim(again, hits)
    assert bm.num_free_blocks == 2


class DigestResidency:
    """Every adapter resident; v1 and v2 of one name have different manifest digests."""

    max_adapters_per_step = 8
    digests = {"chat@v1": "sha256:aaaa", "chat@v2": "sha256:bbbb"}

    def is_ready(self, key):
        return True

    def request(self, key):
        pass

    def acquire(self, key):
        pass

    def release(self, key):
        pass

    def digest(self, key):
        return self.digests[key]


def fake_engine(fake_runner_cls, enable_prefix_caching=True, **runner_kwargs):
    runner = fake_runner_cls(**runner_kwargs)
    runner.residency = DigestResidency()
    config = EngineConfig(
        model="fake", max_num_batched_tokens=64, enable_prefix_caching=enable_prefix_caching
    )
    return LLMEngine(config, runner=runner), runner


def run(engine: LLMEngine, prompt: list[int], adapter: str | None, max_tokens: int = 8) -> list[int]:
    seq = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), adapter=adapter)
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids


def test_versions_of_one_name_and_the_base_share_no_kv(fake_runner_cls):
    engine, runner = fake_engine(fake_runner_cls)
    prompt = list(range(1, 30))
    blocks = engine.scheduler.block_manager
    for adapter in ("chat@v1", "chat@v2", None):
        assert run(engine, prompt, adapter) == runner.reference(prompt, 8)
        assert blocks.prefix_hit_tokens == 0, f"{adapter} reused KV computed under another adapter"
    assert run(engine, prompt, "chat@v1") == runner.reference(prompt, 8)
    assert blocks.prefix_hit_tokens == 28  # 7 full blocks of 4; the last prompt token is recomputed


def test_shared_system_prompt_is_reused_and_outputs_stay_exact(fake_runner_cls):
    rng = random.Random(0)
    system = [rng.randrange(97) for _ in range(23)]
    prompts = [system + [rng.randrange(97) for _ in range(rng.randint(1, 9))] for _ in range(8)]
    engine, runner = fake_engine(fake_runner_cls, num_kv_blocks=40)
    engine.add_request(prompts[0], SamplingParams(max_tokens=4), adapter="chat@v1")
    engine.step()  # the system prompt's blocks are registered
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12), adapter="chat@v1") for p in prompts[1:]]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == [runner.reference(p, 12) for p in prompts[1:]]
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens >= 7 * 20  # each later request found 5 of the system prompt's blocks
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("seed", range(3))
def test_eviction_under_pressure_keeps_outputs_exact(fake_runner_cls, seed):
    rng = random.Random(seed)
    stems = [[rng.randrange(97) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    prompts = [rng.choice(stems) + [rng.randrange(97) for _ in range(rng.randint(0, 6))] for _ in range(30)]
    adapters = [rng.choice(["chat@v1", "chat@v2", None]) for _ in prompts]
    engine, runner = fake_engine(fake_runner_cls, num_kv_blocks=24, max_model_len=64)
    outputs = []
    for start in range(0, len(prompts), 5):  # waves, so later waves find (or lost) earlier waves' blocks
        wave = [
            engine.add_request(p, SamplingParams(max_tokens=rng.randint(1, 16)), adapter=a)
            for p, a in zip(prompts[start : start + 5], adapters[start : start + 5], strict=True)
        ]
        while engine.has_unfinished():
            engine.step()
        outputs += [(s.prompt_token_ids, s.output_token_ids) for s in wave]
    assert all(out == runner.reference(p, len(out)) for p, out in outputs)
    assert engine.stats().prefix_cache_hit_tokens > 0


def test_real_model_reuse_equals_a_cold_run(tiny_llama_dir):
    rng = random.Random(1)
    system = rng.choices(range(256), k=26)
    prompts = [system + rng.choices(range(256), k=n) for n in (1, 5, 11)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def engine(caching: bool) -> LLMEngine:
        cfg = EngineConfig(
            model=str(tiny_llama_dir),
            device="cpu",
            block_size=4,
            max_num_batched_tokens=16,  # prompts are chunked too: reuse meets continued prefill
            enable_prefix_caching=caching,
        )
        return LLMEngine(cfg)

    cold = engine(False).generate(prompts, greedy)
    warm = engine(True)
    first = warm.generate(prompts[:1], greedy)  # computes and caches the system prompt
    rest = warm.generate(prompts[1:], greedy)  # starts both on it
    assert first + rest == cold
    assert warm.stats().prefix_cache_hit_tokens >= 2 * 24
    assert warm.generate(prompts[:1], greedy) == cold[:1]  # the whole prompt but its last token is cached
