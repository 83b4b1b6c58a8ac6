"""The engine's public types: what the HTTP side may know of the engine (torch-free).

The HTTP layer sees the engine through ``AsyncEngine`` and these types only, never its internals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class EngineInfo:
    base_hash: str  # sha256 over the base weights (the artifacts module's definition), or "in-memory"
    max_model_len: int
    vocab_size: int
    max_lora_rank: int  # the largest adapter rank the engine accepts
    target_modules: tuple[str, ...]  # PEFT module names an adapter may target
    device: str
    dtype: str
    max_loras: int = 0  # adapters the GPU pools hold at once at max_lora_rank (0: no adapters)
    kv_block_size: int = 0  # tokens per KV block


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    version: str
    digest: str  # the manifest digest: the version's identity
    state: str  # "loaded" (usable) | "warm" (a real forward ran through it) | "failed"
    tier: str  # where its weights are now: "gpu" | "host" | "disk" | "remote" (not fetched to this node yet)
    pinned: bool
    serving: bool  # the alias ``name`` routes to this version
    bytes: int  # weight bytes as held
    rank: int  # the largest rank over its modules
    in_flight: int  # admitted or queued requests using it
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase ("load", "warm", ...)
    error: str | None = None

    @property
    def key(self) -> str:
        return adapter_key(self.name, self.version)


@dataclass(frozen=True, slots=True)
class VerifiedFile:
    """What a fetch verified of the weights file it brought: its digest and the file's identity then. A load
    that finds the file with that identity before and after its read does not hash it again.

    ``file_id`` is ``artifacts.fsutil.file_identity``'s (device, inode, size, mtime ns, ctime ns); the fetch
    vouches that a file with it holds those bytes: it hashed them, and any write since would have moved the
    mtime (the content was written longer ago than a timestamp tick when it was hashed)."""

    sha256: str  # "sha256:<hex>"
    file_id: tuple[int, int, int, int, int]


@dataclass(frozen=True, slots=True)
class RemoteAdapter:
    """An adapter version whose files are not on this node yet (the "remote" tier). The engine registers it
    from what its verified manifest says, and ``fetch`` brings the files when a request (or a warm-up) first
    needs them: on a loader thread, in the loads' pipeline, never on the engine thread.

    ``fetch()`` blocks until the files are in a verified local folder and returns it with the manifest digest
    it verified, and optionally a third item: the ``VerifiedFile`` of its weights (or None); it raises on any
    failure (an exception with a CamelCase ``reason`` names it, else the
    version fails as ``PullFailed``). The serving side owns the folder (the host cache entry) and releases it
    when the version is unloaded."""

    fetch: Callable[[], tuple[Path, str] | tuple[Path, str, VerifiedFile | None]]
    ranks: dict[str, int]  # module -> rank (the largest over layers), from the signed manifest
    nbytes: int  # the bytes the fetch brings (what the loader's byte bound counts)


def adapter_key(name: str, version: str) -> str:
    """The engine's identity of one adapter version: ``name@version``."""
    return f"{name}@{version}"


class AdapterLease:
    """One adapter version kept from being freed while a request still has parts to start on it (the extra
    choices of ``n > 1`` start after the first one's first token). Counted as one request in flight until
    ``release()`` (idempotent; the garbage collector releases a forgotten one)."""

    __slots__ = ("key", "_release", "__weakref__")

    def __init__(self, key: str, release: Any) -> None:
        self.key, self._release = key, release

    @property
    def live(self) -> bool:
        return self._release is not None

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:
        self.release()


class AdapterError(ValueError):
    """An adapter refused or unusable; ``reason`` is CamelCase (copied into the operator's conditions).

    Reasons: BaseMismatch, RankTooHigh, UnknownModule, NonFiniteWeights, UnsupportedAdapter, ShapeMismatch,
    BadAdapterFile, AdapterNotFound, AdapterConflict, AdapterInUse, WarmFailed. The message names the field,
    file or tensor.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class OverloadedError(RuntimeError):
    """Early abort under overload: the request cannot meet its deadline. HTTP answers 429 + Retry-After."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


MEMORY_USES = ("kv", "adapters", "free")  # the unified GPU pool's bytes, by use (StepStats.gpu_memory_bytes)


@dataclass(frozen=True, slots=True)
class StepStats:
    """Handed to step listeners after every engine step, on the engine thread."""

    num_tokens: int
    num_seqs: int
    num_adapters: int  # distinct adapters in the step
    kv_blocks_used: int
    kv_blocks_total: int
    adapter_bytes_gpu: int
    adapter_bytes_budget: int
    # Unified memory only (None in split mode): the shared GPU pool's bytes by MEMORY_USES.
    gpu_memory_bytes: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class QueueStats:
    """The scheduler's queues as of the engine thread's last step or command batch (read at scrape time).

    Adapters are engine keys (``name@version``) of requests running (scheduled) or waiting (queued).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    updated_at: float = 0.0  # wall-clock seconds (time.time()) when the queues last changed


class TokenMatcher(Protocol):
    """One request's place in its grammar (structured output). The engine thread alone calls it: once per step
    to fill the request's row of the allowed-token bitmask, once per sampled token to advance.

    The bitmask is an int32 CPU tensor [N, ceil(V / 32)]: bit ``j`` of word ``w`` of row ``index`` set means
    token ``32 * w + j`` may come next (the layout xgrammar and llguidance fill).
    """

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> None: ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar does not allow it (the request then fails)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and ended (by a stop token, or by itself when it has none)."""
        ...


class Grammar(Protocol):
    """A compiled constraint (SamplingParams.grammar), shared by every request that uses it; each sequence
    gets its own matcher. The HTTP side builds it (with an optional grammar library); the engine imports no
    grammar library."""

    def matcher(self, stop_token_ids: tuple[int, ...]) -> TokenMatcher:
        """A fresh matcher whose grammar ends with one of ``stop_token_ids`` (or by itself when empty)."""
        ...
