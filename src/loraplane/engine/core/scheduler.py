"""Continuous batching with chunked prefill, adapter-aware admission and preemption by recompute (torch-free).

Each step shares one token budget (max_num_batched_tokens): running decodes first, then the running sequences
still prefilling (a long prompt is spread over several steps), then new sequences admitted from the waiting
queue. Admission is adapter-aware (S-LoRA): a sequence is admitted only when its adapter is resident on the
device (otherwise its load is requested and the scheduler looks further down the queue, so nobody waits behind
a loading adapter); sequences whose adapter already runs (or the base) come first, then the other resident
adapters grouped by adapter, oldest group first; a step never holds more distinct adapters than the residency
allows. Aging bounds the unfairness: a waiting sequence passed over (a later arrival admitted ahead of it) for
max_passed_over_s seconds goes first, and nothing later is admitted before it.

When a sequence cannot grow or be admitted, a unified memory (if any) first turns idle adapters' memory into KV
blocks (never an adapter that a queued or running sequence needs); then the most recent arrival among the running
ones is preempted (its blocks freed, recomputed later from its prompt plus its output so far, with its adapter
released) and goes back to the waiting queue in arrival order. With a unified memory, adapter loads leave alone
the KV blocks that the next admissions need. Admitted sequences start on any cached prefix of theirs (prefix caching).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplane.engine.api import AdapterError, OverloadedError
from loraplane.engine.core.block_manager import BlockManager
from loraplane.engine.core.sequence import Sequence, SequenceStatus
from loraplane.engine.lora.residency import AdapterResidency, NullResidency

_MAX_RETRY_AFTER_S = 60.0


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
    failed: list[Sequence] = field(
        default_factory=list
    )  # ended with an error while scheduling (their adapter)

    @property
    def is_decode_only(self) -> bool:
        return all(chunk.num_tokens == 1 for chunk in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def num_sampled(self) -> int:
        return sum(1 for chunk in self.chunks if chunk.sample)

    @property
    def adapters(self) -> set[str]:
        return {chunk.seq.adapter for chunk in self.chunks if chunk.seq.adapter is not None}


@dataclass(frozen=True, slots=True)
class QueueLoad:
    """What the overload check reads, published whole after each step (callers may run on other threads)."""

    oldest_queued_at: float | None = None  # the longest-waiting sequence that only waits for room


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        *,
        residency: AdapterResidency | None = None,
        max_passed_over_s: float = 2.0,
        max_waiting_seqs: int | None = None,
        max_queue_wait_s: float | None = None,
        adapter_load_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs: must be > 0, got {max_num_seqs}")
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens: must be > 0, got {max_num_batched_tokens}")
        if max_model_len <= 1:
            raise ValueError(f"max_model_len: must be > 1, got {max_model_len}")
        if not max_passed_over_s >= 0.0:
            raise ValueError(f"max_passed_over_s: must be >= 0, got {max_passed_over_s}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A sequence alone must always fit in the cache, or preempting everyone else could not save it.
        self.max_model_len = min(max_model_len, block_manager.capacity_tokens)
        self.residency = residency if residency is not None else NullResidency()
        self.max_passed_over_s = max_passed_over_s
        self.max_waiting_seqs = max_waiting_seqs
        self.max_queue_wait_s = max_queue_wait_s
        self.adapter_load_timeout_s = adapter_load_timeout_s
        self.clock = clock
        self.waiting: list[Sequence] = []  # in arrival (seq_id) order
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.load = QueueLoad()
        self._freed_seq_ids: list[int] = []
        self._failed: list[Sequence] = []
        self._budget = 0  # tokens left in the step being scheduled

    # --- requests in and out ----------------------------------------------------------------------------
    def check_prompt_len(self, num_prompt_tokens: int) -> None:
        """Refuse a prompt that could never run (rather than leaving it waiting forever)."""
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {num_prompt_tokens} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len} (prompt must be shorter than max_model_len)"
            )

    def check_overload(self) -> None:
        """Refuse a new request early (OverloadedError) when the queue is full or already waits too long.

        Reads only what schedule() publishes whole, so callers on other threads may use it."""
        num_waiting, oldest = len(self.waiting), self.load.oldest_queued_at
        wait_s = 0.0 if oldest is None or not num_waiting else max(0.0, self.clock() - oldest)
        retry_after = min(_MAX_RETRY_AFTER_S, max(1.0, wait_s))
        if self.max_waiting_seqs is not None and num_waiting >= self.max_waiting_seqs:
            raise OverloadedError(
                f"overloaded: {num_waiting} requests are waiting (max_waiting_seqs={self.max_waiting_seqs})",
                retry_after,
            )
        if self.max_queue_wait_s is not None and wait_s > self.max_queue_wait_s:
            raise OverloadedError(
                f"overloaded: queued requests already wait {wait_s:.1f} s "
                f"(max_queue_wait_s={self.max_queue_wait_s})",
                retry_after,
            )

    def add(self, seq: Sequence) -> None:
        self.check_prompt_len(seq.num_prompt_tokens)
        seq.status = SequenceStatus.WAITING
        seq.queued_at = self.clock()
        bisect.insort(self.waiting, seq, key=_arrival)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (stop, length, abort or error), wherever it is, and free its blocks and adapter."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_adapter(seq)
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
        ready = self._adapter_readiness()
        if self.num_preemptions == preemptions_before:  # admitting now would only thrash the cache
            self._admit_waiting(chunks, ready)
        self._publish_load(ready)
        freed, self._freed_seq_ids = self._freed_seq_ids, []
        failed, self._failed = self._failed, []
        return ScheduledBatch(chunks=list(chunks.values()), freed_seq_ids=freed, failed=failed)

    def commit(self, batch: ScheduledBatch) -> None:
        """After the runner wrote the batch's KV: those positions are now cached."""
        for chunk in batch.chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.block_manager.cache_full_blocks(chunk.seq)

    def _schedule_running(self, seq: Sequence, chunks: dict[int, ScheduledChunk]) -> None:
        block_manager, start = self.block_manager, seq.num_computed_tokens
        want = min(len(seq.token_ids) - start, self._budget)
        while block_manager.num_missing_blocks(seq, start + want) > block_manager.num_free_blocks:
            if block_manager.make_room(block_manager.num_missing_blocks(seq, start + want), self._needed()):
                break
            victim = max(self.running, key=_arrival)  # the most recent arrival
            if victim is seq:
                # Nobody younger to take blocks from: compute what fits and wait for older ones to finish.
                want = min(want, block_manager.max_tokens_fitting(seq))
                if want == 0:
                    return
                break
            self._preempt(victim, chunks)
        self._add_chunk(seq, want, chunks)

    def _adapter_readiness(self) -> dict[str | None, bool]:
        """Whether each waiting sequence's adapter is usable now; asks for the others to be loaded, oldest
        waiting request first (the base is always ready). An adapter the residency says can never be ready
        (it raises: unknown, unloaded, failed to load) fails the requests waiting for it, and so does one that
        is still not ready after adapter_load_timeout_s (so a stuck load cannot hold the queue forever)."""
        ready: dict[str | None, bool] = {None: True}
        broken: dict[str, Exception] = {}
        keys = [key for key in dict.fromkeys(seq.adapter for seq in self.waiting) if key is not None]
        for key in keys:  # distinct, oldest first
            try:
                ready[key] = self.residency.is_ready(key)
            except Exception as error:  # noqa: BLE001 - it belongs to the requests of this adapter
                ready[key], broken[key] = False, error
        # When adapter loads may take KV's room (the memory says so), a load must leave the KV room that the
        # next admissions need (queued sequences of the base, of ready adapters, of adapters requested before
        # it, and its own), as far as one step admits.
        room = _Reserve(self) if self.block_manager.memory.reserves_kv else None
        for key in [None, *keys] if room is not None else ():
            if ready.get(key):
                room.add(key)
        for key in keys:
            if ready[key] or key in broken:
                continue
            if room is not None:
                room.add(key)
            try:
                self.residency.request(key)
                # A copy that landed at once (host RAM -> GPU on an idle link, or on the CPU) is usable in
                # this step: otherwise a step runs nothing and the loop sleeps for want of anything to run.
                ready[key] = self.residency.is_ready(key)
            except Exception as error:  # noqa: BLE001 - as above
                broken[key] = error
        if all(ready.values()):
            return ready
        now, timeout = self.clock(), self.adapter_load_timeout_s
        for seq in [seq for seq in self.waiting if not ready[seq.adapter]]:
            error = broken.get(seq.adapter)
            if error is None and now - seq.queued_at > timeout:
                error = AdapterError(
                    "AdapterNotReady",
                    f"adapter {seq.adapter!r} did not become resident within {timeout:g} s "
                    "(EngineConfig.adapter_load_timeout_s)",
                )
            if error is not None:
                seq.error = f"{type(error).__name__}: {error}"
                self.finish(seq, "error")
                self._failed.append(seq)
        return ready

    def _overdue(self, seq: Sequence, now: float) -> bool:
        since = seq.passed_over_since
        return since is not None and now - since >= self.max_passed_over_s

    def _admission_order(self, ready: dict[str | None, bool], now: float) -> list[Sequence]:
        """Overdue sequences first (arrival order), then those whose adapter already runs (or the base), then
        the other resident adapters grouped by adapter, oldest group first."""
        if len(ready) == 1:  # the base alone: arrival order
            return list(self.waiting)
        active = {seq.adapter for seq in self.running}
        group_age: dict[str | None, int] = {}
        for seq in self.waiting:
            group_age.setdefault(seq.adapter, seq.seq_id)

        def rank(seq: Sequence) -> tuple[int, int, int]:
            if self._overdue(seq, now):
                return (0, seq.seq_id, 0)
            if seq.adapter is None or seq.adapter in active:
                return (1, seq.seq_id, 0)
            return (2 if ready[seq.adapter] else 3, group_age[seq.adapter], seq.seq_id)

        return sorted(self.waiting, key=rank)

    def _admit_waiting(self, chunks: dict[int, ScheduledChunk], ready: dict[str | None, bool]) -> None:
        if not self.waiting or self._budget == 0 or len(self.running) >= self.max_num_seqs:
            return  # no room this step: nobody is admitted, so nobody is passed over either
        active = {seq.adapter for seq in self.running if seq.adapter is not None}
        max_adapters = self.residency.max_adapters_per_step
        latest_admitted, now = -1, self.clock()
        for seq in self._admission_order(ready, now):
            if self._budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            overdue = self._overdue(seq, now)
            new_adapter = seq.adapter is not None and seq.adapter not in active
            # ready is re-checked: loading a later adapter may have evicted an earlier one not yet admitted
            usable = ready[seq.adapter] and (seq.adapter is None or self.residency.is_ready(seq.adapter))
            if not usable or (new_adapter and len(active) >= max_adapters):
                if overdue:
                    break  # nobody goes ahead of it: running sequences finish and make room for its adapter
                continue
            if not self._admit(seq, chunks):
                break  # no room in the cache: nobody overtakes on memory
            if seq.adapter is not None:
                active.add(seq.adapter)
            latest_admitted = max(latest_admitted, seq.seq_id)
        for seq in self.waiting:  # aging: note when a later arrival first went ahead
            if seq.seq_id > latest_admitted:
                break
            if seq.seq_id < latest_admitted:
                seq.passed_over += 1
                if seq.passed_over_since is None:
                    seq.passed_over_since = now

    def _admit(self, seq: Sequence, chunks: dict[int, ScheduledChunk]) -> bool:
        block_manager = self.block_manager
        hits = block_manager.lookup(seq)
        cached = len(hits) * block_manager.block_size
        want = min(seq.num_tokens - cached, self._budget)
        # The watermark keeps room for running sequences to grow; an idle engine admits whatever fits.
        keep_watermark = bool(self.running)
        if not block_manager.can_admit(seq, hits, cached + want, keep_watermark):
            need = block_manager.blocks_to_admit(hits, cached + want, keep_watermark)
            # With nothing running, the adapters of later queued requests yield to this one, or none could run.
            keep = self._needed() if self.running else frozenset({seq.adapter})
            if not block_manager.make_room(need, keep):
                return False
        block_manager.claim(seq, hits)
        seq.num_computed_tokens = cached
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.passed_over, seq.passed_over_since = 0, None
        self.running.append(seq)
        if seq.adapter is not None:
            self.residency.acquire(seq.adapter)
        self._add_chunk(seq, want, chunks)
        return True

    def _add_chunk(self, seq: Sequence, num_tokens: int, chunks: dict[int, ScheduledChunk]) -> None:
        start = seq.num_computed_tokens
        end = start + num_tokens
        if len(seq.block_table) * self.block_manager.block_size < end:  # most decodes stay inside their block
            self.block_manager.allocate(seq, end)
        chunks[seq.seq_id] = ScheduledChunk(seq, start, num_tokens, end == len(seq.token_ids))
        self._budget -= num_tokens

    def _preempt(self, seq: Sequence, chunks: dict[int, ScheduledChunk]) -> None:
        """Free seq's KV and adapter and queue it again, in arrival order, to recompute prompt + output."""
        chunk = chunks.pop(seq.seq_id, None)
        if chunk is not None:
            self._budget += chunk.num_tokens
        self.running.remove(seq)
        self._release_adapter(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        seq.queued_at = self.clock()
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_arrival)

    def _needed(self) -> frozenset:
        """Adapters that queued or running sequences need: never evicted to make room for KV."""
        return frozenset(seq.adapter for seq in self.waiting + self.running if seq.adapter is not None)

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            self.residency.release(seq.adapter)

    def _publish_load(self, ready: dict[str | None, bool]) -> None:
        if self.max_queue_wait_s is None:
            return  # nobody reads it
        # A sequence that waits for its adapter to load says nothing about the queue: it is left out.
        times = [seq.queued_at for seq in self.waiting if ready.get(seq.adapter, True)]
        self.load = QueueLoad(oldest_queued_at=min(times) if times else None)


class _Reserve:
    """The KV blocks kept out of adapter loads' reach: those of the queued sequences that one step could admit
    (free seats, token budget), taken adapter by adapter: ready ones first, then each one requested."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.block_manager = block_manager = scheduler.block_manager
        self.blocks: dict[str | None, list[int]] = {}
        for seq in scheduler.waiting:
            self.blocks.setdefault(seq.adapter, []).append(block_manager.blocks_for(seq.num_tokens))
        self.seats = max(0, scheduler.max_num_seqs - len(scheduler.running))
        self.cap = self.block_manager.blocks_for(scheduler.max_num_batched_tokens) + self.seats
        self.reserved = 0

    def add(self, key: str | None) -> None:
        taken = self.blocks.get(key, [])[: self.seats]
        self.seats -= len(taken)
        self.reserved = min(self.cap, self.reserved + sum(taken))
        self.block_manager.reserve_for_kv(self.reserved)


def _arrival(seq: Sequence) -> int:
    return seq.seq_id
