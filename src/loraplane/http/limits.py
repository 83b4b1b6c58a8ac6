"""Per-key limits: requests in flight and tokens per minute; a refusal says when to come back.

All state lives on the event loop thread (no locks). A request admitted under a tokens-per-minute limit
reserves its prompt and its whole ``max_tokens`` at once, so requests admitted together cannot all pass
on a budget none of them has used yet; as its tokens come out they move from the reservation into the
key's last-60-s count, and when it ends, whatever it did not generate is given back. A key is admitted
while its counted plus reserved tokens are below its limit, so it overshoots by at most one request; a key
at or above it is refused until enough of the last 60 s of its tokens age out. A key at its concurrency
waits for nobody: it is refused at once (429, Retry-After 1).
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
    reserved: int = 0  # tokens that requests in flight may still generate

    def count(self, now: float, tokens: int) -> None:
        if tokens > 0:
            self.tokens.append((now, tokens))
            self.total += tokens

    def expire(self, now: float) -> None:
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.total -= self.tokens.popleft()[1]


class KeyLimits:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[int, _Usage] = {}

    def admit(self, principal: Principal, prompt_tokens: int, max_tokens: int) -> Ticket:
        """Count one request in, reserving its tokens (or raise LimitExceeded); the ticket settles it."""
        usage = self._usage.setdefault(principal.key_index, _Usage())
        now = self._clock()
        usage.expire(now)
        if principal.max_concurrency is not None and usage.in_flight >= principal.max_concurrency:
            raise LimitExceeded(
                f"this key allows {principal.max_concurrency} requests at once; {usage.in_flight} are running",
                1,
            )
        tpm = principal.tokens_per_minute
        if tpm is not None and usage.total + usage.reserved >= tpm:
            raise LimitExceeded(
                f"this key allows {tpm} tokens per minute; {usage.total} were used in the last 60 s and "
                f"{usage.reserved} are reserved by its requests in flight",
                self._time_until_below(usage, tpm - usage.reserved, now),
            )
        usage.in_flight += 1
        usage.count(now, prompt_tokens)
        return Ticket(self, usage, max_tokens)

    def _time_until_below(self, usage: _Usage, limit: int, now: float) -> float:
        """Until the counted tokens age below ``limit``; 1 s when only requests in flight can free room."""
        if limit <= 0:
            return 1
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
    """One admitted request: its generated tokens move from its reservation into the count; release settles."""

    __slots__ = ("_limits", "_usage", "_reserved", "_done")

    def __init__(self, limits: KeyLimits, usage: _Usage, max_tokens: int) -> None:
        self._limits, self._usage, self._done = limits, usage, False
        self._reserved = max(0, max_tokens)
        usage.reserved += self._reserved

    def add_tokens(self, tokens: int) -> None:
        """Generated tokens: counted now, and no longer reserved."""
        self._usage.count(self._limits._clock(), tokens)
        self._unreserve(tokens)

    def _unreserve(self, tokens: int) -> None:
        freed = min(tokens, self._reserved)
        self._reserved -= freed
        self._usage.reserved -= freed

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._usage.in_flight -= 1
            self._unreserve(self._reserved)  # what it never generated is no longer spoken for
