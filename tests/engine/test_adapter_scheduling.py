"""Adapter-aware admission: resident adapters only, no head-of-line blocking behind a loading adapter, grouping
by adapter, the cap on distinct adapters per step, a bound on how long a request can be passed over, and
acquire()/release() exactly paired with admission and finish/abort/preemption."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loraplane.engine.api import AdapterError
from loraplane.engine.core.block_manager import BlockManager
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.llm_engine import LLMEngine
from loraplane.engine.core.scheduler import ScheduledBatch, Scheduler
from loraplane.engine.core.sequence import SamplingParams, Sequence, SequenceStatus


class FakeResidency:
    """A GPU pool of `slots` adapters. request() starts a load that lands `load_steps` ticks later, and only
    into a free slot or over an adapter nobody holds (acquired adapters are never evicted)."""

    def __init__(self, slots=4, load_steps=2, max_adapters_per_step=4, resident=()):
        self.slots = slots
        self.load_steps = load_steps
        self.max_adapters_per_step = max_adapters_per_step
        self.resident: list[str] = list(resident)  # least recently loaded first
        self.loading: dict[str, int] = {}
        self.held: Counter[str] = Counter()
        self.requests: list[str] = []
        self.log: list[tuple[str, str]] = []

    def is_ready(self, key: str) -> bool:
        return key in self.resident

    def request(self, key: str) -> None:
        self.requests.append(key)
        if key not in self.resident:
            self.loading.setdefault(key, self.load_steps)

    def acquire(self, key: str) -> None:
        assert key in self.resident, f"acquired {key} before it was resident"
        self.held[key] += 1
        self.log.append(("acquire", key))

    def release(self, key: str) -> None:
        assert self.held[key] > 0, f"released {key} more often than acquired"
        self.held[key] -= 1
        self.log.append(("release", key))

    def digest(self, key: str) -> str:
        return f"sha256:{key}"

    def tick(self) -> None:
        for key in list(self.loading):
            self.loading[key] = max(0, self.loading[key] - 1)
            if self.loading[key] == 0 and self._make_room():
                del self.loading[key]
                self.resident.append(key)

    def _make_room(self) -> bool:
        if len(self.resident) < self.slots:
            return True
        idle = [key for key in self.resident if self.held[key] == 0]
        if idle:
            self.resident.remove(idle[0])
        return bool(idle)


class StepClock:
    """One second per engine step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(residency, num_blocks=256, max_num_seqs=8, max_tokens_per_step=64, max_passed_over_s=16.0):
    bm = BlockManager(num_blocks, 4, watermark=0.0)
    return Scheduler(
        bm,
        max_num_seqs,
        max_tokens_per_step,
        1024,
        residency=residency,
        max_passed_over_s=max_passed_over_s,
        adapter_load_timeout_s=1e9,
        clock=StepClock(),
    )


def add(sched: Scheduler, adapter: str | None, prompt_len: int = 3, max_tokens: int = 4) -> Sequence:
    seq = Sequence(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), adapter=adapter)
    sched.add(seq)
    return seq


def check_pairing(sched: Scheduler, residency: FakeResidency) -> None:
    running = Counter(seq.adapter for seq in sched.running if seq.adapter is not None)
    assert +residency.held == running, "acquire/release out of step with the running sequences"


def step(sched: Scheduler, residency: FakeResidency) -> ScheduledBatch:
    batch = sched.schedule()
    assert len(batch.adapters) <= residency.max_adapters_per_step
    assert all(residency.is_ready(key) for key in batch.adapters)
    check_pairing(sched, residency)
    sched.commit(batch)
    for chunk in batch.chunks:
        if chunk.sample:
            chunk.seq.append_token(7)
            if chunk.seq.num_output_tokens >= chunk.seq.sampling.max_tokens:
                sched.finish(chunk.seq, "length")
    residency.tick()
    sched.clock.now += 1.0
    return batch


def admitted(batch: ScheduledBatch) -> list[Sequence]:
    return [chunk.seq for chunk in batch.chunks if chunk.start == 0]


def test_a_loading_adapter_blocks_nobody_behind_it():
    residency = FakeResidency(resident=["ready@1"], load_steps=3)
    sched = make(residency)
    cold, base, warm = add(sched, "cold@1"), add(sched, None), add(sched, "ready@1")
    assert admitted(step(sched, residency)) == [base, warm]
    assert cold.status is SequenceStatus.WAITING and residency.requests == ["cold@1"]
    while cold.status is SequenceStatus.WAITING:
        step(sched, residency)
    assert residency.is_ready("cold@1") and len(set(residency.requests)) == 1


def test_an_adapter_ready_as_soon_as_it_is_requested_is_admitted_in_that_step():
    class Instant(FakeResidency):  # a host-tier copy that lands at once
        def request(self, key: str) -> None:
            super().request(key)
            self.loading.pop(key, None)
            self.resident.append(key)

    residency = Instant()
    sched = make(residency)
    seq = add(sched, "host@1")
    assert admitted(step(sched, residency)) == [seq]


def test_running_adapters_first_then_resident_ones_grouped_by_adapter():
    residency = FakeResidency(resident=["a@1", "b@1", "c@1"])
    sched = make(residency, max_num_seqs=1)
    first = add(sched, "a@1", max_tokens=50)
    step(sched, residency)  # a@1 now runs
    sched.max_num_seqs = 8
    waiting = [add(sched, key) for key in ["c@1", "b@1", "a@1", "c@1", None, "b@1", "a@1"]]
    order = [seq.adapter for seq in admitted(step(sched, residency))]
    assert order == ["a@1", None, "a@1", "c@1", "c@1", "b@1", "b@1"]
    assert first.status is SequenceStatus.RUNNING and all(s.status is SequenceStatus.RUNNING for s in waiting)


def test_distinct_adapters_per_step_are_capped():
    residency = FakeResidency(slots=8, resident=[f"a{i}@1" for i in range(6)], max_adapters_per_step=2)
    sched = make(residency, max_num_seqs=16)
    seqs = [add(sched, f"a{i % 6}@1", max_tokens=3) for i in range(18)] + [add(sched, None)]
    batches = []
    while sched.has_unfinished():
        batches.append(step(sched, residency))  # step() asserts the cap
    assert all(seq.finish_reason == "length" for seq in seqs)
    assert max(len(b.adapters) for b in batches) == 2
    assert +residency.held == Counter()


def adversarial_run(max_passed_over_s: float, steps: int = 120) -> tuple[Sequence, int, int]:
    """One pool slot; a hot adapter gets a new request every step, so its adapter is always running and
    preferred; the victim needs another adapter, which can only load once nobody holds the hot one."""
    residency = FakeResidency(slots=1, load_steps=1, max_adapters_per_step=1, resident=["hot@1"])
    sched = make(residency, max_num_seqs=4, max_passed_over_s=max_passed_over_s)
    add(sched, "hot@1", max_tokens=3)
    step(sched, residency)
    victim = add(sched, "cold@1", max_tokens=2)
    admitted_at, worst = -1, 0
    for index in range(steps):
        add(sched, "hot@1", max_tokens=3)
        step(sched, residency)
        worst = max([worst] + [seq.passed_over for seq in sched.waiting])
        if admitted_at < 0 and victim.status is not SequenceStatus.WAITING:
            admitted_at = index
    return victim, admitted_at, worst


def test_aging_bounds_how_long_a_request_is_passed_over():
    victim, admitted_at, worst = adversarial_run(max_passed_over_s=5.0)
    assert worst <= 5, "a request was passed over for longer than the bound (one step per second)"
    # passed over 5 times, then nothing later is admitted: the running hot requests (3 tokens) drain, the
    # slot frees, its adapter loads (1 step) and it runs
    assert 0 <= admitted_at <= 5 + 3 + 2
    assert victim.num_output_tokens > 0
    # the same pattern starves it without the bound
    starved, never, _ = adversarial_run(max_passed_over_s=1e9)
    assert never == -1 and starved.status is SequenceStatus.WAITING


@pytest.mark.parametrize("seed", range(4))
def test_acquire_and_release_pair_exactly_through_preemption_and_abort(seed):
    rng = random.Random(seed)
    keys = [None, "a@1", "b@1", "c@2", "d@1"]
    residency = FakeResidency(slots=3, load_steps=rng.randint(0, 3), max_adapters_per_step=2)
    sched = make(residency, num_blocks=rng.randint(8, 14), max_num_seqs=6, max_tokens_per_step=16)
    seqs = []
    for _ in range(150):
        if rng.random() < 0.4:
            seqs.append(
                add(sched, rng.choice(keys), prompt_len=rng.randint(1, 12), max_tokens=rng.randint(1, 12))
            )
        if rng.random() < 0.05 and seqs:
            sched.finish(rng.choice(seqs), "abort")
        step(sched, residency)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        step(sched, residency)
    assert all(seq.is_finished for seq in seqs)
    assert sched.num_preemptions > 0, "the cache was meant to run out"
    assert +residency.held == Counter()
    acquires = Counter(key for op, key in residency.log if op == "acquire")
    releases = Counter(key for op, key in residency.log if op == "release")
    assert acquires == releases and sum(acquires.values()) >= sum(
        1 for s in seqs if s.adapter and s.output_token_ids
    )


def test_an_adapter_that_can_never_load_fails_only_its_requests(fake_runner_cls):
    class Residency(FakeResidency):
        def request(self, key):
            if key == "broken@1":
                raise AdapterError("WarmFailed", "adapter broken@1: non-finite logits while warming")
            super().request(key)

    runner = fake_runner_cls()
    runner.residency = Residency(resident=["ok@1"])
    engine = LLMEngine(EngineConfig(model="fake"), runner=runner)
    good = engine.add_request([1, 2], SamplingParams(max_tokens=3), request_id="good", adapter="ok@1")
    engine.add_request([1, 2], SamplingParams(max_tokens=3), request_id="bad", adapter="broken@1")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        runner.residency.tick()
    [bad] = [o for o in outputs if o.request_id == "bad"]
    assert (bad.finished, bad.finish_reason) == (True, "error")
    assert bad.error == "AdapterError: adapter broken@1: non-finite logits while warming"
    assert good.output_token_ids == runner.reference([1, 2], 3)
    assert +runner.residency.held == Counter()


def test_a_load_that_never_finishes_fails_its_requests_after_the_timeout():
    residency = FakeResidency(slots=1, load_steps=10**9, resident=["ok@1"])
    sched = Scheduler(BlockManager(64, 4), 8, 64, 1024, residency=residency, adapter_load_timeout_s=30.0,
                      clock=StepClock())  # fmt: skip
    stuck, fine = add(sched, "stuck@1"), add(sched, None, max_tokens=100)
    failed = []
    for _ in range(40):
        batch = sched.schedule()
        failed += batch.failed
        sched.commit(batch)
        sched.clock.now += 1.0
    assert failed == [stuck] and stuck.finish_reason == "error"
    assert stuck.error.startswith("AdapterError: adapter 'stuck@1' did not become resident within 30 s")
    assert fine.status is SequenceStatus.RUNNING
