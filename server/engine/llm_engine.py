"""The serving loop: schedule -> runner.execute -> postprocess (torch-free; the runner owns the device).

One call to step() advances every scheduled sequence by one chunk and returns one RequestOutput per sequence
that sampled a token (plus the ones aborted since the last step). The caller drives it: generate() for offline
use and tests, AsyncEngine's background thread for serving.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, TokenizerLike
from .scheduler import ScheduledBatch, Scheduler
from .sequence import SamplingParams, Sequence, validate_prompt

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str  # the text delta since the previous output ("" without a tokenizer)
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort' once finished
    num_prompt_tokens: int
    num_output_tokens: int  # so far, including new_token_ids
    # Parallel to new_token_ids: {token_id: logprob} with the sampled token and the requested top ones.
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    num_preemptions: int  # since start


def _build_runner(config: EngineConfig):
    from .model_runner import ModelRunner  # torch is imported only when a real model is served

    if config.tensor_parallel_size > 1:  # TP hook: spawns the workers, returns rank 0's runner
        from .parallel.launch import start_tp_runner

        return start_tp_runner(config)
    return ModelRunner(config)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, runner: Any = None, tokenizer: TokenizerLike | None = None
    ) -> None:
        self.config = config
        self.runner = runner if runner is not None else _build_runner(config)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(self.runner.eos_token_ids)
        block_manager = BlockManager(self.runner.num_kv_blocks, self.runner.block_size)
        self.scheduler = Scheduler(
            block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.runner.max_model_len
        )
        self.max_model_len = self.scheduler.max_model_len
        self._requests: dict[str, Sequence] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}  # by seq_id, only with a tokenizer
        self._aborted: list[RequestOutput] = []  # reported by the next step()
        self._request_ids = itertools.count()

    # --- requests -----------------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError (naming the field) for a request that can never run; reads no mutable state."""
        validate_prompt(prompt_token_ids)
        self.scheduler.check_prompt_len(len(prompt_token_ids))
        if sampling.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop: stop strings need an engine built with a tokenizer")

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
        self.scheduler.add(seq)
        self._requests[request_id] = seq
        if self.tokenizer is not None:
            self._detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, stop=sampling.stop
            )
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now; False if it is unknown or already finished."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        self._aborted.append(self._output(seq, [], None))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

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
        )

    # --- the loop -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        sampled = self._execute(batch)
        self.scheduler.commit(batch)
        return self._postprocess(batch, sampled)

    def _execute(self, batch: ScheduledBatch) -> list:
        if batch.chunks:
            sampled = self.runner.execute(batch)
            if len(sampled) != batch.num_sampled:
                raise RuntimeError(
                    f"runner returned {len(sampled)} tokens for {batch.num_sampled} sampling chunks"
                )
            return sampled
        if batch.freed_seq_ids:
            self.runner.release(batch.freed_seq_ids)
        return []

    def _postprocess(self, batch: ScheduledBatch, sampled: list) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        sampling_chunks = (chunk for chunk in batch.chunks if chunk.sample)
        for chunk, token in zip(sampling_chunks, sampled, strict=True):
            outputs.append(self._append_token(chunk.seq, token))
        return outputs

    def _append_token(self, seq: Sequence, token: Any) -> RequestOutput:
        token_id = int(token.token_id)
        seq.append_token(token_id)
        reason = self._finish_reason(seq, token_id)
        if reason is not None:
            self._finish(seq, reason)
        return self._output(seq, [token_id], self._logprobs(seq, token))

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        sampling = seq.sampling
        if token_id in sampling.stop_token_ids or (
            not sampling.ignore_eos and token_id in self.eos_token_ids
        ):
            return "stop"  # the stop token's text is never part of the output
        detokenizer = self._detokenizers.get(seq.seq_id)
        if detokenizer is not None and detokenizer.add_token(token_id):
            return "stop"
        if seq.num_output_tokens >= sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        del self._requests[seq.request_id]

    @staticmethod
    def _logprobs(seq: Sequence, token: Any) -> list[dict[int, float]] | None:
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
