"""AsyncEngine: per-token streams, abort (by id and by a client leaving), error propagation, idle sleep."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from loraplane.engine.core.async_engine import AsyncEngine
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.errors import EngineDeadError
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.sequence import SamplingParams


@pytest.fixture
def make_async(fake_runner_cls):
    engines = []

    def make(step_delay: float = 0.0, **runner_kwargs):
        class SlowRunner(fake_runner_cls):
            def execute(self, batch):
                time.sleep(step_delay)  # keeps long requests alive long enough to be aborted mid-way
                return super().execute(batch)

        runner = SlowRunner(**runner_kwargs)
        engine = AsyncEngine(LLMEngine(EngineConfig(model="fake"), runner=runner))
        engines.append(engine)
        return engine, runner

    yield make
    for engine in engines:
        engine.close()


async def wait_until(predicate, what: str) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def collect(stream) -> list:
    return [out async for out in stream]


async def test_streams_one_output_per_token(make_async):
    engine, runner = make_async()
    prompt = [5, 6, 7]
    outs = await collect(engine.add_request(prompt, SamplingParams(max_tokens=12), request_id="r"))
    assert [t for o in outs for t in o.new_token_ids] == runner.reference(prompt, 12)
    assert all(len(o.new_token_ids) == 1 for o in outs)
    assert [o.finished for o in outs] == [False] * 11 + [True]
    assert outs[-1].finish_reason == "length"


async def test_concurrent_requests_each_get_their_tokens(make_async):
    engine, runner = make_async()
    prompts = [[i, i + 1, i * 3 % 97] for i in range(8)]
    results = await asyncio.gather(
        *(collect(engine.generate(p, SamplingParams(max_tokens=10 + i))) for i, p in enumerate(prompts))
    )
    for i, (prompt, outs) in enumerate(zip(prompts, results, strict=True)):
        assert [t for o in outs for t in o.new_token_ids] == runner.reference(prompt, 10 + i)
    assert max(len(b.chunks) for b in runner.batches) > 1  # they really were batched


async def test_abort_ends_the_stream_and_frees_blocks(make_async):
    engine, runner = make_async(step_delay=0.002)
    stream = engine.add_request([1, 2, 3], SamplingParams(max_tokens=200), request_id="long")
    outs = []
    async for out in stream:
        outs.append(out)
        if len(outs) == 3:
            engine.abort("long")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs) < 200
    bm = engine.engine.scheduler.block_manager
    await wait_until(lambda: bm.num_free_blocks == bm.num_blocks, "blocks freed")


async def test_client_leaving_aborts_its_request(make_async):
    engine, runner = make_async(step_delay=0.002)
    stream = engine.add_request([1, 2, 3], SamplingParams(max_tokens=200), request_id="gone")
    async for out in stream:
        assert not out.finished
        break
    await stream.aclose()
    seq_ids = [c.seq.seq_id for c in runner.batches[0].chunks]
    await wait_until(lambda: seq_ids[0] in runner.released, "aborted sequence released")
    bm = engine.engine.scheduler.block_manager
    await wait_until(lambda: bm.num_free_blocks == bm.num_blocks, "blocks freed")
    # The same id may be used again once the first request is gone.
    outs = await collect(engine.add_request([4], SamplingParams(max_tokens=2), request_id="gone"))
    assert outs[-1].finish_reason == "length"


async def test_breaking_out_of_the_loop_aborts_its_request(make_async):
    engine, runner = make_async(step_delay=0.002)
    async for out in engine.add_request([1, 2, 3], SamplingParams(max_tokens=200)):
        assert not out.finished
        break  # the dropped generator is closed by the event loop's async-generator finalizer
    bm = engine.engine.scheduler.block_manager
    await wait_until(
        lambda: not engine.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks, "abort"
    )
    assert sum(1 for b in runner.batches for c in b.chunks if c.sample) < 200


async def test_cancelled_reader_aborts_its_request(make_async):
    engine, runner = make_async(step_delay=0.002)
    started = asyncio.Event()

    async def reader():
        async for _ in engine.add_request([9, 9], SamplingParams(max_tokens=200), request_id="c"):
            started.set()

    task = asyncio.create_task(reader())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    bm = engine.engine.scheduler.block_manager
    await wait_until(
        lambda: not engine.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks, "abort"
    )


async def test_loop_error_reaches_every_stream(make_async):
    engine, runner = make_async(step_delay=0.001)
    runner.fail_on_step = 3
    streams = [engine.add_request([i + 1], SamplingParams(max_tokens=50)) for i in range(3)]
    for stream in streams:
        with pytest.raises(EngineDeadError, match="fake runner failure"):
            await collect(stream)
    with pytest.raises(EngineDeadError, match="failed"):
        engine.add_request([1])


async def test_bad_requests_raise_at_once(make_async):
    engine, _ = make_async(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(16)))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([])
    stream = engine.add_request([1], SamplingParams(max_tokens=3), request_id="same")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([1], request_id="same")
    assert len(await collect(stream)) == 3


async def test_idle_thread_sleeps_and_close_ends_open_streams(make_async):
    engine, runner = make_async()
    await collect(engine.add_request([1], SamplingParams(max_tokens=2)))
    steps = len(runner.batches)
    await asyncio.sleep(0.05)
    assert len(runner.batches) == steps  # no busy stepping while idle
    assert engine._thread.is_alive()
    engine.close()
    assert not engine._thread.is_alive()
    with pytest.raises(EngineDeadError, match="closed"):
        engine.add_request([1])


async def test_close_wakes_waiting_streams(fake_runner_cls):
    gate = threading.Event()

    class GatedRunner(fake_runner_cls):
        def execute(self, batch):
            gate.wait()
            return super().execute(batch)

    engine = AsyncEngine(LLMEngine(EngineConfig(model="fake"), runner=GatedRunner()))
    stream = engine.add_request([1, 2], SamplingParams(max_tokens=100))
    closing = asyncio.create_task(engine.aclose())
    await wait_until(lambda: engine._closed, "close() requested while a step is running")
    gate.set()
    await closing
    with pytest.raises(EngineDeadError, match="closed"):
        await collect(stream)
