"""Continuous batching with chunked prefill and preemption by recompute (torch-free).

Each step shares one token budget (max_num_batched_tokens): running decodes first, then the running sequences
still prefilling (a long prompt is spread over several steps), then new sequences admitted strictly in arrival
order. Arrival order also decides who loses KV blocks: when a sequence cannot grow, the most recently arrived
running sequence is preempted (its blocks freed, recomputed later from its prompt plus its output so far) and
goes back to the front of the waiting queue, so older requests always make progress and nobody starves.

Invariant: every running sequence arrived before every waiting one, and both lists are in arrival (seq_id) order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # == seq.num_computed_tokens at scheduling time
    num_tokens: int  # compute positions [start, start + num_tokens) of seq.token_ids
    sample: bool  # True when start + num_tokens == seq.num_tokens -> a new token is sampled


@dataclass(slots=True)
class ScheduledBatch:
    chunks: list[ScheduledChunk]
    freed_seq_ids: list[int] = field(default_factory=list)  # finished/aborted since last step

    @property
    def is_decode_only(self) -> bool:
        return all(chunk.num_tokens == 1 for chunk in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def num_sampled(self) -> int:
        return sum(1 for chunk in self.chunks if chunk.sample)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs: must be > 0, got {max_num_seqs}")
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens: must be > 0, got {max_num_batched_tokens}")
        if max_model_len <= 1:
            raise ValueError(f"max_model_len: must be > 1, got {max_model_len}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A sequence alone must always fit in the cache, or preempting everyone else could not save it.
        self.max_model_len = min(max_model_len, block_manager.capacity_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._freed_seq_ids: list[int] = []
        self._budget = 0  # tokens left in the step being scheduled

    # --- requests in and out ----------------------------------------------------------------------------
    def check_prompt_len(self, num_prompt_tokens: int) -> None:
        """Refuse a prompt that could never run (rather than leaving it waiting forever)."""
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {num_prompt_tokens} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len} (prompt must be shorter than max_model_len)"
            )

    def add(self, seq: Sequence) -> None:
        self.check_prompt_len(seq.num_prompt_tokens)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (stop, length or abort), wherever it is, and free its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._freed_seq_ids.append(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self._budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        chunks: dict[int, ScheduledChunk] = {}  # by seq_id, in scheduling order
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in self.running:
            (decodes if len(seq.token_ids) - seq.num_computed_tokens == 1 else prefills).append(seq)
        for seq in decodes + prefills:
            if self._budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING:  # not preempted earlier in this step
                self._schedule_running(seq, chunks)
        if self.num_preemptions == preemptions_before:  # admitting now would only thrash the cache
            self._admit_waiting(chunks)
        freed, self._freed_seq_ids = self._freed_seq_ids, []
        return ScheduledBatch(chunks=list(chunks.values()), freed_seq_ids=freed)

    def commit(self, batch: ScheduledBatch) -> None:
        """After the runner wrote the batch's KV: those positions are now cached."""
        for chunk in batch.chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens

    def _schedule_running(self, seq: Sequence, chunks: dict[int, ScheduledChunk]) -> None:
        block_manager, start = self.block_manager, seq.num_computed_tokens
        want = min(len(seq.token_ids) - start, self._budget)
        while block_manager.num_missing_blocks(seq, start + want) > block_manager.num_free_blocks:
            victim = self.running[-1]  # the most recent arrival
            if victim is seq:
                # Nobody younger to take blocks from: compute what fits and wait for older ones to finish.
                want = min(want, block_manager.max_tokens_fitting(seq))
                if want == 0:
                    return
                break
            self._preempt(victim, chunks)
        self._add_chunk(seq, want, chunks)

    def _admit_waiting(self, chunks: dict[int, ScheduledChunk]) -> None:
        while self.waiting and self._budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            want = min(seq.num_tokens - seq.num_computed_tokens, self._budget)
            # The watermark keeps room for running sequences to grow; an idle engine admits whatever fits.
            if not self.block_manager.can_allocate(seq, want, keep_watermark=bool(self.running)):
                return  # strict FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_chunk(seq, want, chunks)

    def _add_chunk(self, seq: Sequence, num_tokens: int, chunks: dict[int, ScheduledChunk]) -> None:
        start = seq.num_computed_tokens
        end = start + num_tokens
        if len(seq.block_table) * self.block_manager.block_size < end:  # most decodes stay inside their block
            self.block_manager.allocate(seq, end)
        chunks[seq.seq_id] = ScheduledChunk(seq, start, num_tokens, end == len(seq.token_ids))
        self._budget -= num_tokens

    def _preempt(self, seq: Sequence, chunks: dict[int, ScheduledChunk]) -> None:
        """Free seq's KV and queue it first for recompute over prompt + output so far."""
        chunk = chunks.pop(seq.seq_id, None)
        if chunk is not None:
            self._budget += chunk.num_tokens
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Victims go youngest first, so pushing each to the front keeps the queue in arrival order.
        self.waiting.appendleft(seq)
