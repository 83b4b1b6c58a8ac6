"""One request's state (Sequence) and its sampling parameters (torch-free)."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

MAX_LOGPROBS = 20
SEED_LIMIT = 1 << 63  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as OpenAI


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    PREEMPTED = auto()  # back in the waiting queue after its KV was freed; recomputes from token 0
    FINISHED = auto()


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> disabled
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return (0 -> only the sampled token's)
    # Logits processing, as vLLM defines it (the sampler applies them per row, in this order):
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are masked until this many tokens exist
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt + output tokens
    min_p: float = 0.0  # after temperature: drop tokens with prob < min_p * the top token's prob
    # Structured output: an api.Grammar (compiled by the HTTP side); each sequence gets its own matcher, and
    # the sampler keeps that row's tokens inside the grammar.
    grammar: Any = None

    def __post_init__(self) -> None:
        _require(
            _is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            f"must be a finite number >= 0, got {self.temperature!r}",
        )
        _require(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be an int >= 0, got {self.top_k!r}")
        _require(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT),
            "seed",
            f"must be None or an int in [0, 2^63), got {self.seed!r}",
        )
        _require(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            f"must be an int >= 1, got {self.max_tokens!r}",
        )
        if isinstance(self.stop, str):  # a lone string is one stop string, not its characters
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            f"must be non-empty strings, got {self.stop!r}",
        )
        self.stop_token_ids = tuple(self.stop_token_ids)
        _require(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be ints >= 0, got {self.stop_token_ids!r}",
        )
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        _require(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )

        self._check_processing()

    def _check_processing(self) -> None:
        self.logit_bias = tuple((t, b) for t, b in self.logit_bias)
        _require(
            all(
                _is_int(t) and t >= 0 and _is_number(b) and abs(b) <= MAX_LOGIT_BIAS
                for t, b in self.logit_bias
            ),
            "logit_bias",
            f"must be (token id >= 0, bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]) pairs",
        )
        _require(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value!r}")
        _require(
            _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"must be in (0, 2], got {self.repetition_penalty!r}",
        )
        _require(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            f"must be in [0, 1], got {self.min_p!r}",
        )
        _require(
            self.grammar is None or callable(getattr(self.grammar, "matcher", None)),
            "grammar",
            "must be None or an object with a matcher(stop_token_ids) method (engine.api.Grammar)",
        )
        _require(
            self.grammar is None or self.min_tokens == 0,
            "min_tokens",
            "cannot be combined with a grammar (the grammar decides where the output may end)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty needs the counts of this request's prompt and output tokens."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def validate_prompt(prompt_token_ids: list[int]) -> None:
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids: must hold at least one token")
    if not all(_is_int(t) and t >= 0 for t in prompt_token_ids):
        raise ValueError("prompt_token_ids: must be ints >= 0")


class Sequence:
    """One request: its tokens, its KV bookkeeping (block table, computed tokens) and its lifecycle."""

    __slots__ = (
        "seq_id",
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "token_ids",
        "sampling",
        "adapter",
        "num_computed_tokens",
        "block_table",
        "status",
        "arrival_time",
        "finish_reason",
        "stop_reason",
        "error",
        "num_preemptions",
        "cache_salt",
        "block_hashes",
        "num_cached_blocks",
        "passed_over",
        "passed_over_since",
        "queued_at",
        "matcher",
    )
    _ids = itertools.count()

    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> None:
        prompt = list(prompt_token_ids)
        validate_prompt(prompt)
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else f"req-{self.seq_id}"
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt)  # prompt + output, kept in step so the runner never concatenates
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.adapter = adapter  # the multi-LoRA issue uses it; ignored by the base engine
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.arrival_time = time.monotonic()
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.error: str | None = None  # why it failed, when finish_reason == "error"
        self.num_preemptions = 0
        # Prefix caching: the adapter's identity salts every block hash (never the adapter's name alone);
        # block_hashes[i] identifies the content of full block i of token_ids (chained over blocks 0..i).
        self.cache_salt = ""
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0  # leading blocks of block_table registered in the prefix cache
        self.passed_over = 0  # steps in which a later arrival was admitted while this one waited
        self.passed_over_since: float | None = None  # when that first happened (the scheduler's clock)
        self.queued_at = self.arrival_time  # when it last entered the waiting queue (the scheduler's clock)
        self.matcher = None  # api.TokenMatcher of sampling.grammar (the engine makes it), else None

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request_id={self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
