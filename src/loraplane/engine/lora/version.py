"""One registered adapter version's record in the tiers: identity, where it stands, who holds it, and the
digest of its weights file that a reload must match."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.engine.api import AdapterError, RemoteAdapter


@dataclass(slots=True)
class AdapterVersion:
    name: str
    version: str
    digest: str
    folder: Path | None  # None while it is remote: its files are not on this node yet
    rank: int
    pool_bytes: int  # what it costs in the GPU pools
    pinned: bool = False
    state: str = "loaded"  # loaded | warm | failed
    error: str | None = None
    refs: int = 0  # running sequences (acquire / release)
    in_flight: int = 0  # requests submitted and not finished (the async engine counts them)
    unloading: bool = False  # takes no new requests; freed once nothing uses it
    timings: dict[str, float] = field(default_factory=dict)
    loading: Future | None = None  # a disk -> host parse on the loader
    error_reason: str | None = None
    sha256: str | None = None  # of the weights file as first read: a reload must match it
    ranks: dict[str, int] = field(default_factory=dict)  # module -> rank (what it needs in each pool)
    hashing: Future | None = None  # the first read's hash, (digest, seconds), while sha256 is unknown
    file_id: tuple | None = None  # the weights file's identity when it hashed to sha256
    remote: RemoteAdapter | None = None  # how its files are fetched, when it was registered remote


def known_sha256(v: AdapterVersion) -> str | None:
    """The digest a reload must match: the first read's (its hash long finished by the time of a reload)."""
    if v.sha256 is None and v.hashing is not None:
        v.sha256, v.timings["disk_hash"] = v.hashing.result()
        v.hashing = None
    return v.sha256


def load_failure(key: str, v: AdapterVersion | None) -> AdapterError | None:
    """Why ``v`` cannot be made resident when its load (a pull or a parse) failed, named by the load's own
    reason; None unless its load failed."""
    if v is None or v.state != "failed" or v.error_reason in (None, "WarmFailed"):
        return None
    return AdapterError(v.error_reason, f"adapter {key!r}: {v.error}")
