"""Continuous batching: budgets, chunked prefill, starvation, preemption by recompute, FCFS fairness, abort."""

from __future__ import annotations

import random

import pytest

from loraplane.engine.core.block_manager import BlockManager
from loraplane.engine.core.scheduler import ScheduledBatch, Scheduler
from loraplane.engine.core.sequence import SamplingParams, Sequence, SequenceStatus


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=32, max_model_len=1024, caching=False
):
    bm = BlockManager(num_blocks, block_size, watermark=0.0, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs, max_tokens_per_step, max_model_len)


def add(sched: Scheduler, prompt_len: int, max_tokens: int = 8) -> Sequence:
    seq = Sequence(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    return seq


def check_invariants(sched: Scheduler, batch: ScheduledBatch) -> None:
    bm = sched.block_manager
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(batch.chunks) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    for chunk in batch.chunks:
        seq = chunk.seq
        assert seq.status is SequenceStatus.RUNNING
        assert chunk.num_tokens > 0
        assert chunk.start == seq.num_computed_tokens
        assert len(seq.block_table) * bm.block_size >= chunk.start + chunk.num_tokens
        assert chunk.sample == (chunk.start + chunk.num_tokens == seq.num_tokens)
    owners: dict[int, int] = {}
    for seq in sched.running:
        for block_id in seq.block_table:
            owners[block_id] = owners.get(block_id, 0) + 1
    assert all(bm.ref_counts[b] == n for b, n in owners.items()), "refcounts disagree with block tables"
    assert len(owners) + bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    for seq in sched.running:  # a block is shared only as a cached prefix, never one being written
        assert all(owners[b] == 1 for b in seq.block_table[seq.num_computed_tokens // bm.block_size :])
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    arrival = [s.seq_id for s in sched.waiting]
    assert arrival == sorted(arrival), "waiting must stay in arrival order"


def step(sched: Scheduler) -> ScheduledBatch:
    """One engine step with a model that always samples token 7."""
    batch = sched.schedule()
    check_invariants(sched, batch)
    sched.commit(batch)
    for chunk in batch.chunks:
        if chunk.sample:
            chunk.seq.append_token(7)
            if chunk.seq.num_output_tokens >= chunk.seq.sampling.max_tokens:
                sched.finish(chunk.seq, "length")
    return batch


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[ScheduledBatch]:
    batches = []
    while sched.has_unfinished():
        batches.append(step(sched))
        assert len(batches) < max_steps, "scheduler hung"
    return batches


def test_prefill_then_decode():
    sched = make_scheduler()
    seq = add(sched, 5, max_tokens=3)
    first = step(sched)
    assert [(c.start, c.num_tokens, c.sample) for c in first.chunks] == [(0, 5, True)]
    assert not first.is_decode_only
    second = step(sched)
    assert [(c.start, c.num_tokens) for c in second.chunks] == [(5, 1)]
    assert second.is_decode_only
    run_to_completion(sched)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 3
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    sched = make_scheduler(max_tokens_per_step=16)
    seq = add(sched, 40, max_tokens=2)
    chunks = [step(sched).chunks[0] for _ in range(3)]
    assert [(c.start, c.num_tokens, c.sample) for c in chunks] == [
        (0, 16, False),
        (16, 16, False),
        (32, 8, True),
    ]
    assert seq.num_output_tokens == 1


def test_decodes_go_first_then_prefill_chunks_share_the_budget():
    sched = make_scheduler(max_tokens_per_step=16)
    decoders = [add(sched, 3, max_tokens=100) for _ in range(4)]
    step(sched)  # all four prefill in one step (12 tokens)
    long = add(sched, 50, max_tokens=2)
    batch = step(sched)
    assert [c.seq for c in batch.chunks[:4]] == decoders
    assert all(c.num_tokens == 1 for c in batch.chunks[:4])
    assert batch.chunks[4].seq is long and batch.chunks[4].num_tokens == 12
    assert batch.num_tokens == 16


def test_long_prompt_neither_starves_nor_is_starved():
    sched = make_scheduler(max_tokens_per_step=8, max_num_seqs=8, num_blocks=256)
    short = [add(sched, 2, max_tokens=40) for _ in range(4)]
    step(sched)
    long = add(sched, 100, max_tokens=3)
    later = add(sched, 2, max_tokens=2)  # arrives after the long prompt: must not overtake it
    steps_until_long_sampled = 0
    while long.num_output_tokens == 0:
        before = {s.seq_id: s.num_tokens for s in short}
        prefilled_before = long.num_computed_tokens
        batch = step(sched)
        steps_until_long_sampled += 1
        assert all(s.num_tokens == before[s.seq_id] + 1 for s in short), "decodes starved by the long prompt"
        assert long.num_computed_tokens > prefilled_before or long.num_output_tokens, "long prompt starved"
        assert later.num_computed_tokens == 0 or long.num_output_tokens, (
            "later arrival overtook the long prompt"
        )
        assert batch.num_tokens <= 8
    assert steps_until_long_sampled == 25  # 100 tokens at 8 - 4 decodes per step
    run_to_completion(sched)
    assert later.finish_reason == "length"


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [add(sched, 3, max_tokens=2) for _ in range(5)]
    batch = step(sched)
    assert [c.seq for c in batch.chunks] == seqs[:2]
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    run_to_completion(sched)
    assert all(s.finish_reason == "length" for s in seqs)


def test_out_of_blocks_preempts_the_youngest_and_requeues_it_first():
    # 4 blocks of 4 tokens: two sequences of 7 prompt tokens hold 2 blocks each; growing past 8 needs a 5th.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    old, young = add(sched, 7, max_tokens=6), add(sched, 7, max_tokens=6)
    newcomer = add(sched, 2, max_tokens=1)
    step(sched)  # both prefill (newcomer does not fit), each samples its 8th token
    assert sched.waiting[0] is newcomer
    batch = step(sched)  # position 7 still fits in block 1 for both
    assert len(batch.chunks) == 2
    batch = step(sched)  # position 8 needs a third block each: the young one is preempted
    assert [c.seq for c in batch.chunks] == [old]
    assert young.status is SequenceStatus.PREEMPTED and young.num_preemptions == 1
    assert young.block_table == [] and young.num_computed_tokens == 0
    assert list(sched.waiting) == [young, newcomer], "preempted sequence must go back to the front"
    assert sched.num_preemptions == 1
    progress = young.num_output_tokens
    run_to_completion(sched)
    assert old.finish_reason == young.finish_reason == newcomer.finish_reason == "length"
    assert young.num_output_tokens == 6 > progress  # it recomputed prompt + output, then went on


def test_recompute_prefills_prompt_plus_output():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    add(sched, 7, max_tokens=9)
    young = add(sched, 7, max_tokens=6)
    for _ in range(3):
        step(sched)
    assert young.status is SequenceStatus.PREEMPTED
    generated = young.num_output_tokens
    while young.status is not SequenceStatus.RUNNING:
        batch = step(sched)
    chunk = next(c for c in batch.chunks if c.seq is young)
    assert (chunk.start, chunk.num_tokens, chunk.sample) == (0, 7 + generated, True)


def test_several_preemptions_keep_arrival_order():
    sched = make_scheduler(
        num_blocks=6, block_size=2, max_num_seqs=8, max_tokens_per_step=64, max_model_len=12
    )
    seqs = [add(sched, 3, max_tokens=8) for _ in range(3)]
    late = add(sched, 1, max_tokens=1)
    preempted_order = []
    for _ in range(6):
        step(sched)
        for seq in seqs:
            if seq.status is SequenceStatus.PREEMPTED and seq not in preempted_order:
                preempted_order.append(seq)
    assert preempted_order, "the cache was meant to run out"
    assert preempted_order[0] is seqs[-1]  # youngest first
    waiting_ids = [s.seq_id for s in sched.waiting]
    assert waiting_ids == sorted(waiting_ids)
    assert sched.waiting[-1] is late or late.is_finished
    run_to_completion(sched)
    assert all(s.num_output_tokens == 8 for s in seqs)


def test_abort_frees_blocks_running_and_waiting():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    running, waiting = add(sched, 10, max_tokens=50), add(sched, 3)
    step(sched)
    assert sched.block_manager.num_free_blocks == 5
    sched.finish(running, "abort")
    sched.finish(waiting, "abort")
    sched.finish(waiting, "abort")  # idempotent
    assert sched.block_manager.num_free_blocks == 8
    assert running.finish_reason == "abort" and running.is_finished
    assert not sched.has_unfinished()
    assert sched.schedule().freed_seq_ids == [running.seq_id, waiting.seq_id]
    assert sched.schedule().freed_seq_ids == []


def test_prompt_that_can_never_fit_is_rejected():
    sched = make_scheduler(num_blocks=64, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        add(sched, 32)
    # The cache holds 4 * 4 = 16 tokens: a longer max_model_len would let one sequence outgrow it.
    small = make_scheduler(num_blocks=4, block_size=4, max_model_len=1000)
    assert small.max_model_len == 16
    with pytest.raises(ValueError, match="prompt_token_ids"):
        add(small, 20)
    add(small, 15, max_tokens=100)  # fits alone; the engine stops it at max_model_len


def test_lone_sequence_uses_the_whole_cache_despite_watermark():
    bm = BlockManager(num_blocks=4, block_size=4, watermark=0.25)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    seq = add(sched, 15)
    assert step(sched).chunks[0].seq is seq
    other = add(sched, 1)
    step(sched)
    assert other.status is SequenceStatus.WAITING  # no room: waits, nobody is preempted for a newcomer


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_respects_limits_and_finishes(seed, caching):
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=rng.randint(6, 16),
        block_size=rng.choice([1, 2, 4]),
        max_num_seqs=rng.randint(2, 8),
        max_tokens_per_step=rng.randint(4, 24),
        max_model_len=32,
        caching=caching,
    )
    seqs = []
    for _ in range(200):
        if rng.random() < 0.3 and len(seqs) < 25:
            prompt = rng.randint(1, min(20, sched.max_model_len - 1))
            seqs.append(add(sched, prompt, max_tokens=rng.randint(1, sched.max_model_len - prompt)))
        if rng.random() < 0.05 and seqs:
            sched.finish(rng.choice(seqs), "abort")
        step(sched)
    run_to_completion(sched)
    assert all(s.is_finished for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
