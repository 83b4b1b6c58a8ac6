"""Traffic splits for canary rollouts: a name's requests go to a canary version with a weight, and each version's
requests, errors and time to first token are counted for the operator's analysis.

A split is per adapter name: ``canary`` (a warm version loaded beside the serving one) and ``weight`` (percent).
A request that names the alias (not ``name@version``) goes to the canary when the stable hash of its route key
falls in the first ``weight`` percent of the buckets. The route key is, in order: the ``X-Loraplane-Route-Key``
header, the body's ``user`` field, the caller's API key (its name in the keys file); a request with none of them
is placed at random. So one conversation (one key) stays on one version for a step, and since a larger weight
only adds buckets, a key on the canary stays there as the weight grows.

Each split keeps a *window*: the counts since its canary and weight were last set (setting the same ones again
keeps the window, so a restarted operator re-applying a step does not lose it). Counts live only for names with a
split, two versions each: the cardinality is bounded by the splits the operator sets.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from loraplane.engine.api import OverloadedError, adapter_key
from loraplane.http.models import USABLE_STATES, Target

ROUTE_KEY_HEADER = "X-Loraplane-Route-Key"
BUCKETS = 10_000  # weight percent * 100: a hundredth of a percent per bucket
# TTFT histogram bounds: 1 ms * 2^(i/8), i = 0..143 (1 ms to about 250 s), 9% apart: the operator merges pods'
# histograms and reads a quantile to within one bucket.
TTFT_BOUNDS = tuple(round(0.001 * 2 ** (i / 8), 6) for i in range(144))


def bucket(name: str, route_key: str) -> int:
    """The stable bucket (0..BUCKETS-1) of a route key for adapter ``name``: the same on every pod and restart."""
    digest = hashlib.sha256(f"{name}\x00{route_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


@dataclass(slots=True)
class VersionStats:
    """One version's counts in a split's window."""

    requests: int = 0  # finished requests (completed or failed; client aborts are not counted)
    errors: int = 0  # requests the server failed (the engine failed them or died): not refusals, not aborts
    ttft: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BOUNDS) + 1))  # the last slot: +Inf

    def observe_ttft(self, seconds: float) -> None:
        self.ttft[bisect.bisect_left(TTFT_BOUNDS, seconds)] += 1

    def view(self) -> dict:
        """``ttft``: the non-empty buckets as {upper bound in seconds (str; "+Inf"): count}."""
        bounds = [str(b) for b in TTFT_BOUNDS] + ["+Inf"]
        histogram = {bounds[i]: n for i, n in enumerate(self.ttft) if n}
        return {"requests": self.requests, "errors": self.errors, "ttft": histogram}


@dataclass(slots=True)
class Split:
    name: str
    canary: str  # the version a weight of the traffic goes to
    weight: int  # percent, 0..100
    since: float = field(default_factory=time.time)  # the window's start (epoch seconds)
    versions: dict[str, VersionStats] = field(default_factory=dict)

    def stats(self, version: str) -> VersionStats:
        return self.versions.setdefault(version, VersionStats())

    def view(self, stable: str | None) -> dict:
        versions = {v: s.view() for v, s in sorted(self.versions.items())}
        for version in (stable, self.canary):  # both sides present, even before their first request
            if version is not None:
                versions.setdefault(version, VersionStats().view())
        return {"name": self.name, "stable": stable, "canary": self.canary, "weight": self.weight,
                "since": self.since, "window_s": round(time.time() - self.since, 3), "versions": versions}  # fmt: skip


class Splits:
    """Every split of this server; every method runs on the event loop thread."""

    def __init__(self) -> None:
        self._splits: dict[str, Split] = {}

    def get(self, name: str) -> Split | None:
        return self._splits.get(name)

    def all(self) -> list[Split]:
        return [self._splits[n] for n in sorted(self._splits)]

    def set(self, name: str, canary: str, weight: int) -> Split:
        """Route ``weight`` percent of ``name`` to ``canary``; a new window unless both are unchanged."""
        current = self._splits.get(name)
        if current is not None and (current.canary, current.weight) == (canary, weight):
            return current
        self._splits[name] = split = Split(name, canary, weight)
        return split

    def drop(self, name: str, version: str | None = None) -> bool:
        """Remove ``name``'s split (only if its canary is ``version``, when given). True if one went."""
        split = self._splits.get(name)
        if split is None or version not in (None, split.canary):
            return False
        del self._splits[name]
        return True

    def route(self, engine, target: Target, route_key: str | None) -> Target:
        """``target`` (the alias resolved to its serving version), or the canary for this route key's bucket."""
        split = self._splits.get(target.adapter) if target.adapter else None
        if split is None or split.weight <= 0:
            return target
        place = bucket(split.name, route_key) if route_key else random.randrange(BUCKETS)
        if place >= split.weight * (BUCKETS // 100):
            return target
        key = adapter_key(split.name, split.canary)
        # Only a usable canary: one being unloaded answers as the stable version, never as a 404.
        if any(a.key == key and a.state in USABLE_STATES for a in engine.adapters(split.name)):
            return Target(split.name, key)
        return target

    async def watch(self, target: Target, stream: AsyncIterator) -> AsyncIterator:
        """``stream`` unchanged, counted in the window of ``target``'s split (if its name has one)."""
        split = self._splits.get(target.adapter) if target.adapter else None
        if split is None or target.version is None:
            async for out in stream:
                yield out
            return
        stats, arrived, timed, finish = split.stats(target.version), time.perf_counter(), False, None
        try:
            async for out in stream:
                if not timed and out.new_token_ids:
                    timed = True
                    stats.observe_ttft(time.perf_counter() - arrived)
                finish = getattr(out, "finish_reason", None) or finish
                yield out
        except (asyncio.CancelledError, GeneratorExit, ValueError, OverloadedError):
            raise  # the client left, its request was refused, or the server was full: not the version's fault
        except Exception:
            stats.requests += 1
            stats.errors += 1
            raise
        if finish != "abort":
            stats.requests += 1


def route_key(header: str | None, user: str | None, key_name: str | None) -> str | None:
    """The request's route key: the header, else the body's ``user``, else the API key's name (None: random)."""
    for value, kind in ((header, "h"), (user, "u"), (key_name, "k")):
        if value:
            return f"{kind}:{value}"
    return None
