"""The remote tier: adapter versions registered from their signed manifest, whose files a fetch brings to
this node when a request first needs them (``engine.api.RemoteAdapter``).

The fetch is the serving side's (the S3 pull into the host cache, with its signature, base-hash and
per-file checks); it runs on a loader worker as the first half of the version's load (``TierMoves``), and
the engine only checks that it brought the version it registered. Its failure is the version's failure,
named by the fetch's reason, like a folder that fails to parse. The fetch's message (which may name the
source: endpoint, bucket, object) is kept for ``info`` (the admin API) and never told to the version's
requests: they learn the version and the reason.
"""

from __future__ import annotations

from pathlib import Path

from loraplane.engine.api import AdapterError, RemoteAdapter, VerifiedFile
from loraplane.engine.lora.version import AdapterVersion

PULL_FAILED = "PullFailed"  # a fetch that failed without naming a reason


def checked_ranks(key: str, remote: RemoteAdapter, max_rank: int, modules) -> dict[str, int]:
    """The manifest's module -> rank, refused (naming the module) unless the engine can serve it."""
    if not remote.ranks:
        raise AdapterError("BadAdapterFile", f"{key}: ranks: the manifest lists no LoRA module")
    for module, rank in remote.ranks.items():
        if module not in modules:
            raise AdapterError(
                "UnknownModule", f"{key}: ranks: {module!r} is not served (serves {sorted(modules)})"
            )
        if not isinstance(rank, int) or not 0 < rank <= max_rank:
            raise AdapterError("RankTooHigh", f"{key}: ranks: {module} rank {rank!r} is not in 1..{max_rank}")
    if remote.nbytes < 0:
        raise AdapterError("BadAdapterFile", f"{key}: nbytes: must not be negative, got {remote.nbytes}")
    return {m: remote.ranks[m] for m in modules if m in remote.ranks}  # the pools' order


def fetch(key: str, remote: RemoteAdapter, digest: str) -> tuple[Path, VerifiedFile | None]:
    """Run the fetch (a loader worker; blocking) and return the folder it brought, with what it verified of
    the weights file when it says; AdapterError naming the fetch's reason, or ``DigestMismatch`` when it
    brought another version than the one registered."""
    try:
        folder, fetched, *rest = remote.fetch()
        weights = rest[0] if rest else None
        if len(rest) > 1 or not (weights is None or isinstance(weights, VerifiedFile)):
            raise TypeError("fetch must return (folder, digest) or (folder, digest, VerifiedFile | None)")
    except Exception as error:  # noqa: BLE001 - it belongs to the requests of this version
        reason = getattr(error, "reason", None)
        reason = reason if isinstance(reason, str) and reason.isidentifier() else PULL_FAILED
        detail = str(error).removeprefix(f"{reason}: ") or type(error).__name__
        raise AdapterError(reason, f"pull: {detail}") from error
    if fetched != digest:
        raise AdapterError(
            "DigestMismatch", f"pull: {key}: fetched manifest {fetched}, registered as {digest}"
        )
    return Path(folder), weights


def public_error(v: AdapterVersion) -> str | None:
    """What the requests of a failed version are told after its name: the reason, and the message of a
    failure on this node (a parse names the file and tensor); a pull's message stays with the operator."""
    if v.remote is not None and v.folder is None:  # it failed before any file of it reached this node
        return f"{v.error_reason}: the pull of its files failed"
    return v.error
