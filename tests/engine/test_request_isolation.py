"""An error that belongs to one request fails that request alone: values the engine cannot take are refused at
admission naming the field, and a request that makes a step fail is found (by bisecting the step) and failed
while the others go on. Only device faults and broken engine invariants stop the engine."""

from __future__ import annotations

import asyncio

import pytest

from loraplane.engine.core.async_engine import AsyncEngine
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.errors import EngineDeadError, EngineFault, RequestError
from loraplane.engine.core.llm_engine import MAX_ALL_FAILED_STEPS, LLMEngine
from loraplane.engine.core.sequence import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -1}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_sampling_params_refuse_values_the_engine_cannot_take(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)


def test_seed_limits_are_inclusive_where_torch_allows():
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_engine_refuses_values_beyond_its_model_at_admission(fake_runner_cls):
    engine = LLMEngine(EngineConfig(model="fake"), runner=fake_runner_cls(vocab_size=97, max_model_len=64))
    with pytest.raises(ValueError, match=r"SamplingParams\.top_k: .*vocabulary size 97"):
        engine.add_request([1, 2], SamplingParams(top_k=2**63))
    engine.add_request([1, 2], SamplingParams(top_k=97))  # the whole vocabulary is fine
    with pytest.raises(ValueError, match=r"SamplingParams\.max_tokens: .*max_model_len=64"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2**64))
    with pytest.raises(ValueError, match="prompt_token_ids: .*vocabulary size 97"):
        engine.add_request([1, 97])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([2**64])
    assert len(engine.scheduler.waiting) == 1


def run_all(engine: LLMEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_extreme_seed_and_top_k_fail_only_their_request(tiny_llama_dir):
    """The values reach the step (as if admission had missed them): torch overflows for those rows only."""
    cfg = EngineConfig(model=str(tiny_llama_dir), device="cpu", block_size=4, max_num_batched_tokens=64)
    engine = LLMEngine(cfg)
    prompts = {f"ok{i}": [3 + i, 9, 27, 81 % 256, i] for i in range(3)}
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cold = dict(zip(prompts, engine.generate(list(prompts.values()), greedy), strict=True))

    for rid, prompt in prompts.items():
        engine.add_request(prompt, greedy, request_id=rid)
    bad_seed = engine.add_request([1, 2, 3], SamplingParams(temperature=0.8, seed=1, max_tokens=6), "seed")
    bad_top_k = engine.add_request([4, 5], SamplingParams(temperature=0.8, top_k=5, max_tokens=6), "top_k")
    bad_seed.sampling.seed = 2**64  # "Overflow when unpacking long long" in torch.Generator.manual_seed
    bad_top_k.sampling.top_k = 2**63  # overflows torch.tensor(int64)
    outputs = run_all(engine)

    for rid in prompts:
        assert [t for o in outputs[rid] for t in o.new_token_ids] == cold[rid]
        assert outputs[rid][-1].finish_reason == "length" and outputs[rid][-1].error is None
    for rid in ("seed", "top_k"):
        [failed] = outputs[rid]
        assert (failed.finished, failed.finish_reason) == (True, "error")
        assert "overflow" in failed.error.lower()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # the engine serves a later request as before
    assert engine.generate([prompts["ok0"]], greedy) == [cold["ok0"]]


class FlakyRunner:
    """FakeRunner mixin: any step holding a request whose id starts with 'bad' raises a non-device error."""

    error: type[Exception] = OverflowError
    message = "Python int too large to convert to C long"

    def execute(self, batch):
        if any(chunk.seq.request_id.startswith("bad") for chunk in batch.chunks):
            raise self.error(self.message)
        return super().execute(batch)


@pytest.fixture
def flaky_engine(fake_runner_cls):
    def make(error=OverflowError, message="Python int too large to convert to C long"):
        runner_cls = type("Flaky", (FlakyRunner, fake_runner_cls), {"error": error, "message": message})
        runner = runner_cls(num_kv_blocks=128)
        config = EngineConfig(model="fake", max_num_seqs=16, max_num_batched_tokens=256)
        return LLMEngine(config, runner=runner), runner

    return make


def test_bisection_finds_every_culprit_among_many(flaky_engine):
    engine, runner = flaky_engine()
    ids = [f"bad{i}" if i in (2, 9, 10) else f"ok{i}" for i in range(12)]
    prompts = {rid: [i + 1, 2 * i + 1, 7] for i, rid in enumerate(ids)}
    for rid in ids:
        engine.add_request(prompts[rid], SamplingParams(max_tokens=5), request_id=rid)
    outputs = run_all(engine)
    for rid in ids:
        last = outputs[rid][-1]
        if rid.startswith("bad"):
            assert (len(outputs[rid]), last.finish_reason) == (1, "error")
            assert last.error == "OverflowError: Python int too large to convert to C long"
        else:
            assert [t for o in outputs[rid] for t in o.new_token_ids] == runner.reference(prompts[rid], 5)
    assert engine.stats().num_free_kv_blocks == runner.num_kv_blocks
    assert not engine.has_unfinished()


def test_device_fault_stops_the_engine(flaky_engine):
    engine, _ = flaky_engine(RuntimeError, "CUDA error: an illegal memory access was encountered")
    engine.add_request([1, 2], request_id="ok")
    engine.add_request([1, 3], request_id="bad")
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.step()


def test_steps_where_every_request_fails_stop_the_engine_in_the_end(flaky_engine):
    engine, _ = flaky_engine()
    for step in range(1, MAX_ALL_FAILED_STEPS):
        engine.add_request([1, 2], request_id=f"bad{step}")
        [out] = engine.step()
        assert out.finish_reason == "error"
    engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id="ok")  # a good step resets the count
    engine.step()
    for step in range(MAX_ALL_FAILED_STEPS - 1):
        engine.add_request([5], request_id=f"bad-again{step}")
        engine.step()
    engine.add_request([5], request_id="bad-last")
    with pytest.raises(OverflowError):
        engine.step()


def test_broken_runner_invariant_is_an_engine_fault(fake_runner_cls):
    engine = LLMEngine(EngineConfig(model="fake"), runner=fake_runner_cls())
    engine.runner.execute = lambda batch: []
    engine.add_request([1, 2, 3])
    with pytest.raises(EngineFault, match="0 tokens for 1"):
        engine.step()


async def test_async_stream_of_the_culprit_raises_and_the_engine_lives_on(fake_runner_cls):
    runner = type("Flaky", (FlakyRunner, fake_runner_cls), {})()
    engine = AsyncEngine(LLMEngine(EngineConfig(model="fake"), runner=runner))
    try:

        async def collect(stream):
            return [out async for out in stream]

        streams = {rid: engine.add_request([7, 8, i], SamplingParams(max_tokens=6), rid)
                   for i, rid in enumerate(["a", "bad", "b"])}  # fmt: skip
        results = await asyncio.gather(*map(collect, streams.values()), return_exceptions=True)
        good_a, bad, good_b = results
        assert [t for o in good_a for t in o.new_token_ids] == runner.reference([7, 8, 0], 6)
        assert [t for o in good_b for t in o.new_token_ids] == runner.reference([7, 8, 2], 6)
        assert isinstance(bad, RequestError) and "OverflowError" in str(bad) and bad.request_id == "bad"
        assert engine.is_alive()
        later = await collect(engine.add_request([1], SamplingParams(max_tokens=2)))
        assert later[-1].finish_reason == "length"
        # a request the engine thread refuses raises its own error, not EngineDeadError
        stream = engine.add_request([1], SamplingParams(max_tokens=2), request_id="dup")
        engine.engine.max_model_len = 1  # refused on the engine thread's own check
        with pytest.raises(ValueError) as info:
            await collect(stream)
        assert not isinstance(info.value, EngineDeadError)
    finally:
        engine.close()
