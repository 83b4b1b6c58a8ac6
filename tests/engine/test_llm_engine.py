"""The engine loop over a torch-free FakeRunner that really pages (see conftest.FakeRunner)."""

from __future__ import annotations

import random

import pytest

from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.sequence import SamplingParams


def make_engine(fake_runner_cls, tokenizer=None, max_num_seqs=8, max_num_batched_tokens=64, **runner_kwargs):
    runner = fake_runner_cls(**runner_kwargs)
    config = EngineConfig(
        model="fake", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    return LLMEngine(config, runner=runner, tokenizer=tokenizer), runner


def prompts(n: int, seed: int = 0, low: int = 1, high: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(low, high))] for _ in range(n)]


GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def test_single_request_matches_reference(fake_runner_cls):
    engine, runner = make_engine(fake_runner_cls)
    [prompt] = prompts(1)
    assert engine.generate([prompt], GREEDY_64) == [runner.reference(prompt, 64)]
    assert not engine.has_unfinished()
    assert engine.scheduler.block_manager.num_free_blocks == runner.num_kv_blocks


def test_batch_of_different_lengths_matches_reference(fake_runner_cls):
    engine, runner = make_engine(fake_runner_cls, num_kv_blocks=256)
    batch = prompts(6, seed=1)
    assert engine.generate(batch, GREEDY_64) == [runner.reference(p, 64) for p in batch]
    assert any(
        len(b.chunks) > 1 and not b.is_decode_only for b in runner.batches
    )  # mixed prefill + decode steps


def test_preemption_keeps_outputs_exact(fake_runner_cls):
    # 24 blocks of 4 = 96 slots for 6 sequences heading to ~30 + 64 tokens each: preemption is unavoidable.
    engine, runner = make_engine(fake_runner_cls, num_kv_blocks=24, block_size=4, max_model_len=96)
    batch = prompts(6, seed=2)
    outputs = engine.generate(batch, GREEDY_64)
    assert engine.num_preemptions > 0
    assert outputs == [runner.reference(p, 64) for p in batch]
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_kv_blocks, stats.num_kv_blocks) == (
        0,
        0,
        24,
        24,
    )
    assert stats.num_preemptions == engine.num_preemptions


def test_chunked_prefill_keeps_outputs_exact(fake_runner_cls):
    engine, runner = make_engine(fake_runner_cls, max_num_batched_tokens=7, num_kv_blocks=256)
    batch = prompts(4, seed=3, low=20, high=40)
    outputs = engine.generate(batch, GREEDY_64)
    assert outputs == [runner.reference(p, 64) for p in batch]
    assert all(b.num_tokens <= 7 for b in runner.batches)
    assert any(not c.sample for b in runner.batches for c in b.chunks)  # some prompt really was split


def test_finish_reasons(fake_runner_cls):
    engine, runner = make_engine(fake_runner_cls, max_model_len=40)
    [prompt] = prompts(1, seed=4, low=10, high=10)
    ref = runner.reference(prompt, 30)
    stop_token = ref[5]
    first = ref.index(stop_token)

    def finish(sampling, eos=()):
        engine.eos_token_ids = frozenset(eos)
        seq = engine.add_request(prompt, sampling)
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        return seq, outs[-1]

    seq, last = finish(SamplingParams(max_tokens=3))
    assert (last.finish_reason, seq.output_token_ids) == ("length", ref[:3])
    seq, last = finish(SamplingParams(max_tokens=20, stop_token_ids=(stop_token,)))
    assert (last.finish_reason, seq.output_token_ids) == ("stop", ref[: first + 1])
    seq, last = finish(SamplingParams(max_tokens=20), eos=(stop_token,))
    assert (last.finish_reason, seq.output_token_ids) == ("stop", ref[: first + 1])
    seq, last = finish(SamplingParams(max_tokens=20, ignore_eos=True), eos=(stop_token,))
    assert (last.finish_reason, seq.num_output_tokens) == ("length", 20)
    seq, last = finish(SamplingParams(max_tokens=40))  # max_model_len = 40 stops it at 30 new tokens
    assert (last.finish_reason, seq.num_tokens, last.num_output_tokens) == ("length", 40, 30)


def test_outputs_stream_one_token_per_step_with_logprobs(fake_runner_cls):
    engine, runner = make_engine(fake_runner_cls)
    [prompt] = prompts(1, seed=5)
    engine.add_request(prompt, SamplingParams(max_tokens=4, logprobs=1), request_id="a")
    engine.add_request(prompt, SamplingParams(max_tokens=4), request_id="b")
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    by_id = {rid: [o for o in outs if o.request_id == rid] for rid in "ab"}
    assert [len(o.new_token_ids) for o in by_id["a"]] == [1, 1, 1, 1]
    assert [t for o in by_id["a"] for t in o.new_token_ids] == runner.reference(prompt, 4)
    for out in by_id["a"]:
        [entry] = out.logprobs
        assert out.new_token_ids[0] in entry and len(entry) == 2
    assert all(o.logprobs is None for o in by_id["b"])
    assert by_id["a"][-1].num_output_tokens == 4 and by_id["a"][-1].num_prompt_tokens == len(prompt)


def test_abort_frees_blocks_and_reports(fake_runner_cls):
    engine, runner = make_engine(fake_runner_cls)
    [prompt] = prompts(1, seed=6, low=20, high=20)
    seq = engine.add_request(prompt, SamplingParams(max_tokens=50), request_id="x")
    engine.step()
    engine.step()
    assert seq.block_table
    assert engine.abort("x")
    assert not engine.abort("x") and not engine.abort("unknown")
    assert engine.scheduler.block_manager.num_free_blocks == runner.num_kv_blocks
    [out] = engine.step()
    assert (out.request_id, out.finished, out.finish_reason, out.new_token_ids) == ("x", True, "abort", [])
    assert runner.released == [seq.seq_id]
    assert not engine.has_unfinished()


def test_text_stop_strings_and_deltas(fake_runner_cls, byte_bpe_tokenizer):
    tok = byte_bpe_tokenizer
    engine, runner = make_engine(fake_runner_cls, tokenizer=tok, vocab_size=len(tok))
    [prompt] = prompts(1, seed=7)
    ref = runner.reference(prompt, 40)
    full_text = tok.decode(ref, skip_special_tokens=True)
    stop = full_text[10:13]
    assert stop and full_text.find(stop) >= 1
    engine.add_request(prompt, SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True), request_id="s")
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == full_text[: full_text.find(stop)]


def test_min_tokens_holds_stop_strings_and_stop_tokens_back(fake_runner_cls, byte_bpe_tokenizer):
    """As vLLM: before min_tokens nothing but the length ends an answer; after, stop strings and tokens do."""
    tok = byte_bpe_tokenizer
    engine, runner = make_engine(fake_runner_cls, tokenizer=tok, vocab_size=len(tok))
    [prompt] = prompts(1, seed=7)
    ref = runner.reference(prompt, 40)
    early = tok.decode(ref[:3], skip_special_tokens=True)[-1]  # shown within the first 3 tokens
    params = SamplingParams(
        max_tokens=40, min_tokens=12, stop=(early,), stop_token_ids=(ref[0],), ignore_eos=True
    )
    seq = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert seq.output_token_ids == ref[: seq.num_output_tokens] and seq.num_output_tokens > 12
    text = "".join(o.text for o in outs)
    assert text.startswith(tok.decode(ref[:12], skip_special_tokens=True).split(early)[0])
    without = engine.add_request(prompt, SamplingParams(max_tokens=40, stop_token_ids=(ref[0],)))
    while engine.has_unfinished():
        engine.step()
    assert without.num_output_tokens == 1 and without.stop_reason == ref[0]


def test_bad_requests_are_refused(fake_runner_cls):
    engine, _ = make_engine(fake_runner_cls, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len=16"):
        engine.add_request(list(range(16)))
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        engine.add_request([1], SamplingParams(stop=("x",)))
    engine.add_request([1], request_id="dup")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([1], request_id="dup")
    assert len(engine.scheduler.waiting) == 1


def test_runner_returning_the_wrong_number_of_tokens_is_caught(fake_runner_cls):
    engine, runner = make_engine(fake_runner_cls)
    runner.execute = lambda batch: []
    engine.add_request([1, 2, 3])
    with pytest.raises(RuntimeError, match="0 tokens for 1"):
        engine.step()
