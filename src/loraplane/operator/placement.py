"""Which ready pods of a base load an adapter that asks for fewer than all (``spec.placement``).

Rendezvous hashing: every (adapter, pod) pair gets a score from a hash of both names, and an adapter goes to
the pods where it scores highest. Adapters spread evenly over the pods without any shared table, each choice is
made alone (no adapter's placement depends on another's), and a pod that comes or goes moves only the adapters
that ranked it, which keeps warm adapters where they are. An adapter that asks for more pods (a popular one)
keeps its first pods and adds the next ones in its own order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

P = TypeVar("P")


def score(adapter: str, pod: str) -> int:
    """The pair's rank key (stable across processes and Python versions, unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(f"{adapter}\0{pod}".encode()).digest()[:8], "big")


def choose(adapter: str, pods: Sequence[P], count: int, name=lambda p: p.name) -> list[P]:
    """The ``count`` pods of ``pods`` (by ``name(pod)``) that serve ``adapter``, best first."""
    ranked = sorted(pods, key=lambda p: (-score(adapter, name(p)), name(p)))
    return ranked[: max(0, count)]
