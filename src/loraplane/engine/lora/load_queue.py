"""The adapter versions requested toward the GPU and not there yet, in the order they were first requested
(the scheduler requests the oldest waiting request's adapter first), and which of them wait for GPU room.

Fairness: a version may take GPU room only while no older one that requests still wait for is itself
waiting for room that evictions could give it. Without this, a stream of younger adapters that each fit
the rows freed by one finishing request (a smaller rank, or simply asked for first in that step) takes every
freed row before an older, larger one, whose requests then fail at the load timeout although the pool turns
over all the time. An older version waits in line only for room that will free up when the requests now
running end (rows free or held by versions that are idle or only running, not pinned and with no more
requests queued); one that needs more, or that no request waits for any more, blocks nobody.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator


class LoadQueue:
    def __init__(self) -> None:
        self._keys: dict[str, None] = {}  # insertion order: first requested first
        self._no_room: set[str] = set()  # in the queue, its weights in host RAM, the GPU room not free yet

    def add(self, key: str) -> None:
        self._keys.setdefault(key)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)
        self._no_room.discard(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> frozenset[str]:
        return frozenset(self._keys)

    def waits_for_room(self, key: str, waits: bool) -> None:
        """Record whether ``key`` now waits for GPU room that evictions could give it."""
        if waits and key in self._keys:
            self._no_room.add(key)
        else:
            self._no_room.discard(key)

    def may_take_room(self, key: str, wanted_by_requests: Callable[[str], bool]) -> bool:
        """No older version that requests still wait for is waiting for room before ``key``."""
        if not self._no_room:  # the usual case, checked for every queued version every step
            return True
        for other in self._keys:
            if other == key:
                return True
            if other in self._no_room and wanted_by_requests(other):
                return False
        return True
