"""Bearer API keys, read from a file (one key per line, ``#`` comments), compared in constant time.

Only SHA-256 digests of the keys are kept in memory after loading, and no key ever reaches a log line or a
repr. Comparing digests of equal length keeps the comparison's time independent of the key's length too.
The multi-LoRA issue extends this with which adapters a key may use (authenticate() returns the principal).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Principal:
    key_index: int  # the key's line among the file's keys; identifies the caller without the secret


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    __slots__ = ("_digests",)

    def __init__(self, keys: list[str]) -> None:
        keys = [k.strip() for k in keys]
        if not keys or any(not k for k in keys):
            raise ValueError("api_keys: need at least one non-empty key")
        if any(any(c.isspace() for c in k) for k in keys):
            raise ValueError("api_keys: a key must not contain whitespace")
        self._digests = tuple(_digest(k) for k in keys)

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"api_keys_file: cannot read {path}: {exc.strerror}") from None
        keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"api_keys_file: {path} holds no key")
        return cls(keys)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys)"

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The caller behind an ``Authorization: Bearer <key>`` header, or None."""
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return None
        digest = _digest(presented.strip())
        found = -1
        for index, known in enumerate(self._digests):  # no early exit: every key is compared
            if hmac.compare_digest(digest, known):
                found = index
        return Principal(found) if found >= 0 else None
