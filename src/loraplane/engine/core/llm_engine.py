"""The serving loop: schedule -> runner.execute -> postprocess (torch-free; the runner owns the device).

One call to step() advances every scheduled sequence by one chunk and returns one RequestOutput per sequence
that sampled a token (plus the ones aborted since the last step). The caller drives it: generate() for offline
use and tests, AsyncEngine's background thread for serving.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

from loraplane.engine.api import AdapterError, AdapterInfo
from loraplane.engine.core.block_manager import BlockManager
from loraplane.engine.core.config import EngineConfig
from loraplane.engine.core.errors import EngineFault, is_device_fault
from loraplane.engine.core.outputs import EngineStats, RequestOutput
from loraplane.engine.core.runner import Runner, SampledToken
from loraplane.engine.core.scheduler import ScheduledBatch, Scheduler
from loraplane.engine.core.sequence import SamplingParams, Sequence, validate_prompt
from loraplane.engine.model.detokenizer import IncrementalDetokenizer, TokenizerLike

# A step in which every request failed hints at a broken engine rather than bad requests; this many in a row
# stop the engine (its liveness then fails and the pod restarts).
MAX_ALL_FAILED_STEPS = 3

IDLE_WAIT_S = 0.05  # the longest a stalled loop blocks between looks (time-based limits are this coarse)

if TYPE_CHECKING:
    from loraplane.engine.lora.manager import AdapterTiers

log = logging.getLogger(__name__)


def _build_runner(config: EngineConfig) -> Runner:
    from loraplane.engine.model.runner import (
        ModelRunner,  # torch is imported only when a real model is served
    )

    if config.tensor_parallel_size > 1:  # TP hook: spawns the workers, returns rank 0's runner
        from loraplane.engine.parallel.launch import start_tp_runner

        return start_tp_runner(config)
    return ModelRunner(config)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, runner: Runner | None = None, tokenizer: TokenizerLike | None = None
    ) -> None:
        self.config = config
        self.runner: Runner = runner if runner is not None else _build_runner(config)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(self.runner.eos_token_ids)
        block_manager = BlockManager(
            self.runner.num_kv_blocks,
            self.runner.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            memory=self.runner.memory,  # the arbiter KV blocks come from
        )
        self.scheduler = Scheduler(
            block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.runner.max_model_len,
            residency=self.runner.residency,
            max_passed_over_s=config.max_passed_over_s,
            max_waiting_seqs=config.max_waiting_seqs,
            max_queue_wait_s=config.max_queue_wait_s,
            adapter_load_timeout_s=config.adapter_load_timeout_s,
        )
        self.max_model_len = self.scheduler.max_model_len
        self._requests: dict[str, Sequence] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}  # by seq_id, only with a tokenizer
        self._pending: list[RequestOutput] = []  # aborted or failed: reported by the next step()
        self._all_failed_steps = 0  # consecutive steps in which every request failed
        self._request_ids = itertools.count()
        self.stalled = False  # the last step ran nothing and reported nothing: every request waits

    # --- requests -----------------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError (naming the field) for a request the engine cannot take, or OverloadedError when it
        cannot take more now; safe to call from any thread."""
        validate_prompt(prompt_token_ids)
        vocab_size = self.runner.vocab_size
        if max(prompt_token_ids) >= vocab_size:
            raise ValueError(f"prompt_token_ids: token ids must be < the vocabulary size {vocab_size}")
        self.scheduler.check_prompt_len(len(prompt_token_ids))
        if sampling.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop: stop strings need an engine built with a tokenizer")
        bad = next((t for t, _ in sampling.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"SamplingParams.logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})"
            )
        if sampling.top_k > vocab_size:
            raise ValueError(
                f"SamplingParams.top_k: must be at most the vocabulary size {vocab_size}, got {sampling.top_k}"
            )
        if sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"SamplingParams.max_tokens: must be at most max_model_len={self.max_model_len}, "
                f"got {sampling.max_tokens}"
            )
        self.scheduler.check_overload()

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> Sequence:
        sampling = sampling if sampling is not None else SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        seq = Sequence(prompt_token_ids, sampling, request_id=request_id, adapter=adapter)
        self.check_request(seq.prompt_token_ids, sampling)
        if adapter is not None:
            try:  # the version's identity, never its name, keys its prefix-cache blocks
                seq.cache_salt = self.scheduler.residency.digest(adapter)
            except KeyError:
                raise AdapterError("AdapterNotFound", f"adapter: {adapter!r} is not loaded") from None
        if sampling.grammar is not None:  # the grammar ends where the request may stop: its stop tokens
            eos = () if sampling.ignore_eos else tuple(sorted(self.eos_token_ids))
            seq.matcher = sampling.grammar.matcher(tuple(sampling.stop_token_ids) + eos)
        self.scheduler.add(seq)
        self._requests[request_id] = seq
        if self.tokenizer is not None:
            stop = sampling.stop if not sampling.min_tokens else ()  # see _finish_reason
            self._detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, stop=stop
            )
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now; False if it is unknown or already finished."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        self._pending.append(self._output(seq, [], None))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # --- adapters ---------------------------------------------------------------------------------------------
    @property
    def adapters(self) -> AdapterTiers | None:
        """The adapters' versions, aliases and tiers (load, alias, pin, views); None without adapters."""
        return self.runner.lora

    def warm_adapter(self, key: str) -> AdapterInfo:
        """Make ``key`` resident and run one real forward through it (the engine thread: it uses the device).
        AdapterError('WarmFailed') when the logits are not finite; the version is then marked failed."""
        tiers = self.adapters
        if tiers is None:
            raise AdapterError("UnsupportedAdapter", "adapter: this engine serves no adapters")
        tiers.get(key)  # AdapterNotFound once it is unloading
        try:
            seconds = self.runner.warm_adapter(key)
        except AdapterError as error:
            tiers.mark_failed(key, error)
            raise
        tiers.mark_warm(key, seconds)
        return tiers.info(key)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def stats(self) -> EngineStats:
        scheduler, blocks = self.scheduler, self.scheduler.block_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_kv_blocks=blocks.num_free_blocks,
            num_kv_blocks=blocks.num_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_cached_kv_blocks=blocks.num_cached_blocks,
            prefix_cache_queried_tokens=blocks.prefix_queried_tokens,
            prefix_cache_hit_tokens=blocks.prefix_hit_tokens,
            unified_memory=blocks.memory.stats(blocks.num_used_blocks),  # None in the split
        )

    # --- the loop -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        sampled = self._execute(batch)  # a request that makes the step fail is failed alone
        self.scheduler.commit(batch)
        outputs = self._postprocess(batch, sampled)
        self.stalled = not batch.chunks and not outputs
        return outputs

    def idle_wait_s(self) -> float | None:
        """None when the last step did work; else how long the caller may block before stepping again
        (every unfinished request waits for an adapter: a finished load, a new request, an abort or a
        command ends the wait early; the bound lets time-based limits such as adapter_load_timeout_s and
        copies landing on the device be noticed)."""
        if not self.stalled:
            return None
        tiers = self.adapters
        return tiers.idle_wait_s() if tiers is not None else IDLE_WAIT_S

    def _execute(self, batch: ScheduledBatch) -> list:
        if not batch.chunks:
            if batch.freed_seq_ids:
                self.runner.release(batch.freed_seq_ids)
            return []
        try:
            sampled = self._run(batch)
        except Exception as error:  # noqa: BLE001 - sorted below: device faults and engine faults re-raise
            if isinstance(error, EngineFault) or is_device_fault(error):
                raise
            self.runner.release(batch.freed_seq_ids)
            sampled = self._isolate(batch, error)
        else:
            self._all_failed_steps = 0
        return sampled

    def _run(self, batch: ScheduledBatch) -> list:
        sampled = self.runner.execute(batch)
        if len(sampled) != batch.num_sampled:
            raise EngineFault(
                f"runner returned {len(sampled)} tokens for {batch.num_sampled} sampling chunks"
            )
        return sampled

    def _isolate(self, batch: ScheduledBatch, error: Exception) -> list:
        """The step failed: find the requests that fail even alone (bisecting the step), fail those, and keep
        the tokens of the others. Re-running a chunk rewrites the same KV slots with the same values."""
        tokens: dict[int, SampledToken] = {}  # by seq_id
        culprits: list[tuple[Any, Exception]] = []
        self._bisect(batch.chunks, error, tokens, culprits)
        if len(culprits) == len(batch.chunks):
            self._all_failed_steps += 1
            if self._all_failed_steps >= MAX_ALL_FAILED_STEPS:
                raise error  # every request fails, step after step: the engine is broken, not the requests
        else:
            self._all_failed_steps = 0
        for chunk, cause in culprits:
            self._fail_request(chunk.seq, cause)
        batch.chunks = [chunk for chunk in batch.chunks if not chunk.seq.is_finished]
        return [tokens[chunk.seq.seq_id] for chunk in batch.chunks if chunk.sample]

    def _bisect(self, chunks: list, error: Exception, tokens: dict, culprits: list) -> None:
        if len(chunks) == 1:
            culprits.append((chunks[0], error))
            return
        middle = len(chunks) // 2
        for half in (chunks[:middle], chunks[middle:]):
            try:
                sampled = self._run(ScheduledBatch(chunks=half))
            except Exception as half_error:  # noqa: BLE001 - as in _execute
                if isinstance(half_error, EngineFault) or is_device_fault(half_error):
                    raise
                self._bisect(half, half_error, tokens, culprits)
                continue
            sampling = [chunk for chunk in half if chunk.sample]
            tokens.update((chunk.seq.seq_id, token) for chunk, token in zip(sampling, sampled, strict=True))

    def _fail_request(self, seq: Sequence, error: Exception) -> None:
        log.warning("request %s failed in the engine step: %r", seq.request_id, error, exc_info=error)
        seq.error = f"{type(error).__name__}: {error}"
        self._detokenizers.pop(seq.seq_id, None)
        self._finish(seq, "error")
        seq.finish_reason = "error"
        self._pending.append(self._output(seq, [], None))

    def _postprocess(self, batch: ScheduledBatch, sampled: list) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        for seq in batch.failed:  # its adapter can never be ready
            self._requests.pop(seq.request_id, None)
            self._detokenizers.pop(seq.seq_id, None)
            outputs.append(self._output(seq, [], None))
        sampling_chunks = (chunk for chunk in batch.chunks if chunk.sample)
        for chunk, token in zip(sampling_chunks, sampled, strict=True):
            try:
                outputs.append(self._append_token(chunk.seq, token))
            except Exception as error:  # noqa: BLE001 - e.g. a token its detokenizer cannot take
                self._fail_request(chunk.seq, error)
                outputs.extend(self._pending)
                self._pending = []
        return outputs

    def _append_token(self, seq: Sequence, token: SampledToken) -> RequestOutput:
        token_id = int(token.token_id)
        if seq.matcher is not None and not seq.matcher.accept_token(token_id):
            raise ValueError(f"grammar: token {token_id} is outside the request's grammar")
        seq.append_token(token_id)
        reason = self._finish_reason(seq, token_id)
        if reason is None and seq.matcher is not None and seq.matcher.is_terminated():
            reason = "stop"  # a grammar without stop tokens (ignore_eos) ends by itself
        if reason is not None:
            self._finish(seq, reason)
        return self._output(seq, [token_id], self._logprobs(seq, token))

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        sampling = seq.sampling
        detokenizer = self._detokenizers.get(seq.seq_id)
        if seq.num_output_tokens < sampling.min_tokens:  # as vLLM: nothing but the length ends it yet
            if detokenizer is not None:
                detokenizer.add_token(token_id)  # its stop strings are off until then (add_request)
            return "length" if seq.num_tokens >= self.max_model_len else None
        if token_id in sampling.stop_token_ids or (
            not sampling.ignore_eos and token_id in self.eos_token_ids
        ):
            seq.stop_reason = token_id
            return "stop"  # the stop token's text is never part of the output
        if (
            detokenizer is not None
            and sampling.min_tokens
            and seq.num_output_tokens == sampling.min_tokens + 1
        ):
            detokenizer.watch(sampling.stop)  # stop strings count once the output is past min_tokens
        if detokenizer is not None and detokenizer.add_token(token_id):
            seq.stop_reason = detokenizer.stopped_on
            return "stop"
        if seq.num_output_tokens >= sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._requests.pop(seq.request_id, None)

    @staticmethod
    def _logprobs(seq: Sequence, token: SampledToken) -> list[dict[int, float]] | None:
        if seq.sampling.logprobs is None or token.logprob is None:
            return None
        entry = dict(token.top_logprobs or {})
        entry[int(token.token_id)] = float(token.logprob)
        return [entry]

    def _output(self, seq: Sequence, new_token_ids: list[int], logprobs) -> RequestOutput:
        finished = seq.is_finished
        detokenizer = self._detokenizers.get(seq.seq_id)
        text = detokenizer.take_delta(finished) if detokenizer is not None else ""
        if finished:
            self._detokenizers.pop(seq.seq_id, None)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            text=text,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            logprobs=logprobs,
            error=seq.error,
            stop_reason=seq.stop_reason,
        )

    # --- offline convenience ----------------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Run prompts to completion; returns each one's output token ids, in prompt order."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling: {len(params)} SamplingParams for {len(prompts)} prompts")
        seqs = [self.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        while self.has_unfinished():
            self.step()
        return [list(seq.output_token_ids) for seq in seqs]
