"""Per-key limits: requests in flight and tokens per minute; a refusal says when to come back.

All state lives on the event loop thread (no locks). Tokens count when known: the prompt at admission,
the completion as it finishes. A key over its tokens-per-minute is refused until enough of the last 60 s of
its tokens age out; a key at its concurrency waits for nobody: it is refused at once (429, Retry-After 1).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplane.http.auth import Principal

WINDOW_S = 60.0


class LimitExceeded(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = max(1, math.ceil(retry_after_s))


@dataclass(slots=True)
class _Usage:
    in_flight: int = 0
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (monotonic time, tokens)
    total: int = 0  # sum of ``tokens``

    def expire(self, now: float) -> None:
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.total -= self.tokens.popleft()[1]


class KeyLimits:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[int, _Usage] = {}

    def admit(self, principal: Principal, prompt_tokens: int) -> Ticket:
        """Count one request in (or raise LimitExceeded); the ticket counts it out."""
        usage = self._usage.setdefault(principal.key_index, _Usage())
        now = self._clock()
        usage.expire(now)
        if principal.max_concurrency is not None and usage.in_flight >= principal.max_concurrency:
            raise LimitExceeded(
                f"this key allows {principal.max_concurrency} requests at once; {usage.in_flight} are running",
                1,
            )
        tpm = principal.tokens_per_minute
        if tpm is not None and usage.total >= tpm:
            raise LimitExceeded(
                f"this key allows {tpm} tokens per minute; {usage.total} were used in the last 60 s",
                self._time_until_below(usage, tpm, now),
            )
        usage.in_flight += 1
        ticket = Ticket(self, usage)
        ticket.add_tokens(prompt_tokens)
        return ticket

    def _time_until_below(self, usage: _Usage, limit: int, now: float) -> float:
        remaining = usage.total
        for stamp, tokens in usage.tokens:
            remaining -= tokens
            if remaining < limit:
                return stamp + WINDOW_S - now
        return WINDOW_S

    def in_flight(self, principal: Principal) -> int:
        usage = self._usage.get(principal.key_index)
        return usage.in_flight if usage else 0


class Ticket:
    __slots__ = ("_limits", "_usage", "_done")

    def __init__(self, limits: KeyLimits, usage: _Usage) -> None:
        self._limits, self._usage, self._done = limits, usage, False

    def add_tokens(self, tokens: int) -> None:
        if tokens > 0:
            self._usage.tokens.append((self._limits._clock(), tokens))
            self._usage.total += tokens

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._usage.in_flight -= 1
