"""What the engine reports: one ``RequestOutput`` per request per step, and ``EngineStats`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str  # the text delta since the previous output ("" without a tokenizer)
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort' | 'error' once finished
    num_prompt_tokens: int
    num_output_tokens: int  # so far, including new_token_ids
    # Parallel to new_token_ids: {token_id: logprob} with the sampled token and the requested top ones.
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # why the request failed (finish_reason 'error'); the engine goes on
    # finish_reason 'stop': the token id (end of sequence or stop_token_ids) or the stop string that ended it.
    # A stop token is the last of new_token_ids; its text is never part of the output.
    stop_reason: int | str | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    num_preemptions: int  # since start
    num_cached_kv_blocks: int = 0  # full blocks held for prefix reuse (in use or free)
    prefix_cache_queried_tokens: int = 0  # since start: prompt tokens looked up at admission
    prefix_cache_hit_tokens: int = 0  # of those, found cached
    # memory_mode "unified": chunks and bytes as KV, as adapters and free, row fragmentation (None: split).
    # num_free_kv_blocks then counts the blocks KV can take without evicting anything.
    unified_memory: dict | None = None
