"""Early abort under overload: a request that cannot start in time is refused at once with OverloadedError and
a Retry-After hint, instead of queueing past its deadline."""

from __future__ import annotations

import asyncio
import time

import pytest

from loraplane.engine.api import OverloadedError
from loraplane.engine.core.async_engine import AsyncEngine
from loraplane.engine.core.block_manager import BlockManager
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.scheduler import Scheduler
from loraplane.engine.core.sequence import SamplingParams, Sequence


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NotReady:
    """A residency whose adapters never finish loading."""

    max_adapters_per_step = 4

    def is_ready(self, key):
        return False

    def request(self, key):
        pass

    def acquire(self, key):
        raise AssertionError("nothing is ever admitted")

    release = acquire

    def digest(self, key):
        return key


def scheduler(clock, residency=None, **limits) -> Scheduler:
    # one sequence runs at a time, so everyone else waits
    return Scheduler(BlockManager(64, 4), 1, 64, 256, residency=residency, clock=clock, **limits)


def add(sched: Scheduler, adapter=None) -> Sequence:
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=100), adapter=adapter)
    sched.add(seq)
    return seq


def test_queue_length_limit_refuses_with_retry_after():
    sched = scheduler(Clock(), max_waiting_seqs=2)
    for _ in range(3):
        add(sched)
    sched.schedule()  # one runs, two wait
    with pytest.raises(OverloadedError, match="max_waiting_seqs=2") as info:
        sched.check_overload()
    assert info.value.retry_after_s >= 1.0
    sched.finish(sched.waiting[0], "abort")
    sched.check_overload()  # room again


def test_queue_wait_limit_refuses_once_queued_requests_wait_too_long():
    clock = Clock()
    sched = scheduler(clock, max_queue_wait_s=5.0)
    add(sched)
    add(sched)
    sched.schedule()
    clock.now += 4.0
    sched.check_overload()  # the queue is 4 s deep: still within the limit
    clock.now += 3.0
    with pytest.raises(OverloadedError, match=r"wait 7\.0 s \(max_queue_wait_s=5\.0\)") as info:
        sched.check_overload()
    assert info.value.retry_after_s == pytest.approx(7.0)
    sched.finish(sched.waiting[0], "abort")
    sched.schedule()
    sched.check_overload()  # nobody waits any more


def test_waiting_for_an_adapter_to_load_is_not_overload():
    clock = Clock()
    sched = scheduler(clock, residency=NotReady(), max_queue_wait_s=1.0)
    add(sched, adapter="slow@1")
    sched.schedule()
    clock.now += 30.0
    sched.check_overload()


def test_engine_refuses_at_add_time(fake_runner_cls):
    config = EngineConfig(model="fake", max_num_seqs=1, max_waiting_seqs=1)
    engine = LLMEngine(config, runner=fake_runner_cls())
    engine.add_request([1, 2], SamplingParams(max_tokens=20))
    engine.step()
    engine.add_request([3], SamplingParams(max_tokens=20))
    with pytest.raises(OverloadedError) as info:
        engine.add_request([4])
    assert info.value.retry_after_s >= 1.0
    assert len(engine.scheduler.waiting) == 1


async def wait_until(predicate) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never happened")


async def test_async_engine_refuses_before_streaming(fake_runner_cls):
    class Slow(fake_runner_cls):
        def execute(self, batch):
            time.sleep(0.002)
            return super().execute(batch)

    config = EngineConfig(model="fake", max_num_seqs=1, max_waiting_seqs=1)
    engine = AsyncEngine(LLMEngine(config, runner=Slow()))
    scheduler = engine.engine.scheduler
    try:
        first = engine.add_request([1], SamplingParams(max_tokens=200))
        await wait_until(lambda: scheduler.running)
        second = engine.add_request([2], SamplingParams(max_tokens=3))
        await wait_until(lambda: len(scheduler.waiting) == 1)
        with pytest.raises(OverloadedError):
            engine.add_request([3])
        assert [o async for o in first][-1].finish_reason == "length"
        assert [o async for o in second][-1].finish_reason == "length"
        assert [o async for o in engine.add_request([3], SamplingParams(max_tokens=2))][-1].finished
    finally:
        engine.close()
