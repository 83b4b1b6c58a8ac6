"""Registering adapter versions in the tiers (``Registrations``, a base of ``AdapterTiers`` in manager.py): a
parsed version into the host tier, or a version known by its shape alone whose weights stay on disk or in
S3 until a request needs them.

Registering ``name@version`` again with the same digest is idempotent, except for a record being unloaded
(a request still in flight keeps it) or whose load failed: the new registration replaces it whole, with its
own source (folder, or the serving side's fetch) and a fresh state, so the next need loads afresh. The old
record is kept by nothing but what it already started (its load in flight, whose result only it sees).

Any thread, under the manager's ``lock``; it works on the manager's ``versions``, ``unloading``, tiers and
``loader``.
"""

from __future__ import annotations

from pathlib import Path

from loraplane.engine.api import AdapterError, AdapterInfo, RemoteAdapter, adapter_key
from loraplane.engine.lora.remote import checked_ranks
from loraplane.engine.lora.version import AdapterVersion
from loraplane.engine.lora.weights import AdapterWeights, header_ranks


def renewed(v: AdapterVersion) -> bool:
    """A record that a new registration of its version replaces rather than joins."""
    return v.unloading or v.state == "failed"


class Registrations:
    """Putting versions in the registry; a base of ``AdapterTiers``."""

    def register(self, name: str, version: str, folder: Path, digest: str, weights: AdapterWeights | None, *,
                 pin: bool = False, load_s: float = 0.0) -> AdapterInfo:  # fmt: skip
        """A parsed version into the host tier (``weights``), or (None) a version registered again: idempotent
        per name@version and digest; one being unloaded, or whose load failed, is renewed from ``folder``."""
        key = adapter_key(name, version)
        sha256 = (
            weights.digest() if weights is not None else None
        )  # before the lock: it may wait for the hash
        with self.lock:
            old = self._registered(key, digest, pin)
            if old is not None and not renewed(old):
                return self.info(key)
            if old is None and weights is None:
                raise AdapterError("AdapterNotFound", f"adapter {key!r} is not loaded")
            ranks = dict(weights.ranks) if weights is not None else old.ranks
            self._check_pools(key, ranks)
            shape = weights if weights is not None else AdapterWeights(a={}, b={}, ranks=ranks)
            v = AdapterVersion(
                name, version, digest, Path(folder), shape.rank, self.gpu.bytes_for(shape), pin
            )
            v.ranks, v.sha256 = ranks, sha256
            if weights is not None:
                v.timings["load"] = load_s
            self._put_record(key, v, old)
            if weights is not None and key not in self.host.entries:
                self.host.put(key, weights, self._host_evictable)
            return self.info(key)

    def register_on_disk(self, name: str, version: str, folder: Path, digest: str, *,
                         pin: bool = False) -> AdapterInfo:  # fmt: skip
        """Register a version whose weights stay in ``folder`` until a request needs them (only the config
        and the weights file's header are read now; the full checks run when it loads)."""
        ranks = header_ranks(folder, self.model_config, max_rank=self.max_rank)
        return self._register_shape(name, version, Path(folder), digest, ranks, pin)

    def register_remote(self, name: str, version: str, digest: str, remote: RemoteAdapter, *,
                        pin: bool = False) -> AdapterInfo:  # fmt: skip
        """Register a version whose files are not on this node: ``remote.fetch`` brings them on a loader
        worker when a request or a warm-up first needs it (the usual parse and checks follow)."""
        key = adapter_key(name, version)
        ranks = checked_ranks(key, remote, self.max_rank, self.gpu.pools)
        return self._register_shape(name, version, None, digest, ranks, pin, remote)

    def _register_shape(self, name: str, version: str, folder: Path | None, digest: str,
                        ranks: dict[str, int], pin: bool, remote: RemoteAdapter | None = None) -> AdapterInfo:  # fmt: skip
        """A version known by its ranks alone (no weights parsed yet)."""
        key = adapter_key(name, version)
        with self.lock:
            old = self._registered(key, digest, pin)
            if old is not None and not renewed(old):
                return self.info(key)
            self._check_pools(key, ranks)
            shape = AdapterWeights(a={}, b={}, ranks=ranks)
            v = AdapterVersion(name, version, digest, folder, shape.rank, self.gpu.bytes_for(shape), pin)
            v.ranks, v.remote = ranks, remote
            self._put_record(key, v, old)
            return self.info(key)

    def _registered(self, key: str, digest: str, pin: bool) -> AdapterVersion | None:
        """The record ``key`` has (under the lock), refused when it holds another digest; a live one is
        pinned if asked (registering it again is idempotent)."""
        old = self.versions.get(key)
        if old is not None and old.digest != digest:
            raise AdapterError(
                "AdapterConflict", f"{key}: already loaded with digest {old.digest}, not {digest}"
            )
        if old is not None and not renewed(old):
            old.pinned = old.pinned or pin
        return old

    def _check_pools(self, key: str, ranks: dict[str, int]) -> None:
        for m, r in ranks.items():
            if r > self.gpu.pools[m].num_pages:
                raise AdapterError("RankTooHigh", f"{key}: {m} rank {r} exceeds the adapter pool")

    def _put_record(self, key: str, v: AdapterVersion, old: AdapterVersion | None) -> None:
        """Make ``v`` the record of ``key`` (under the lock). It replaces ``old`` (being unloaded, or failed)
        whole: the new registration's source (folder, fetch), state and error, so the next need starts a
        fresh load; the old record keeps its load in flight and whatever its fetch writes. The requests
        counted on the key stay counted (they release the key, not the record), and the weights already in
        the host or GPU tier stay (the same digest: the same verified files). Requests that already failed
        stay failed."""
        if old is not None:
            v.refs, v.in_flight = old.refs, old.in_flight
            self.unloading.discard(key)
        self.loader.detach(key)  # a load the old record (or a freed one) started is not this record's
        self.versions[key] = v
