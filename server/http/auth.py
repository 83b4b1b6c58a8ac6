"""Bearer API keys, read from a file, compared in constant time.

Two file formats: plain text (one key per line, ``#`` comments), or the ``api-keys.yaml`` that the operator
mounts from the LoRABase's apiKeysSecretRef (``keys: [{key: ..., adapters: [...]}]``). Only SHA-256 digests of
the keys are kept after loading, and no key ever reaches a log line or a repr. Comparing digests of equal
length keeps the comparison's time independent of the key's length too. authenticate() returns the
Principal with the adapters its key may use; the multi-LoRA issue enforces them.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Principal:
    key_index: int  # the key's place among the file's keys; identifies the caller without the secret
    adapters: frozenset[str] | None = None  # None: no restriction was written for this key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    __slots__ = ("_digests", "_adapters")

    def __init__(self, keys: list[str], adapters: list[frozenset[str] | None] | None = None) -> None:
        keys = [k.strip() if isinstance(k, str) else "" for k in keys]
        if not keys or any(not k for k in keys):
            raise ValueError("api_keys: need at least one non-empty key")
        if any(any(c.isspace() for c in k) for k in keys):
            raise ValueError("api_keys: a key must not contain whitespace")
        self._digests = tuple(_digest(k) for k in keys)
        self._adapters = tuple(adapters) if adapters is not None else (None,) * len(keys)

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"api_keys_file: cannot read {path}: {exc.strerror}") from None
        keys = [
            line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
        ]
        if keys and keys[0].startswith("keys:"):
            return cls._from_yaml(text, path)
        if not keys:
            raise ValueError(f"api_keys_file: {path} holds no key")
        return cls(keys)

    @classmethod
    def _from_yaml(cls, text: str, path: str | Path) -> ApiKeys:
        import yaml

        try:
            entries = (yaml.safe_load(text) or {}).get("keys") or []
        except yaml.YAMLError as exc:  # its message may quote a line, so a key: name only its kind
            raise ValueError(f"api_keys_file: {path} is not valid YAML ({type(exc).__name__})") from None
        keys, adapters = [], []
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
                raise ValueError(f"api_keys_file: keys[{index}] needs a string `key`")
            allowed = entry.get("adapters")
            if allowed is not None and not (
                isinstance(allowed, list) and all(isinstance(a, str) for a in allowed)
            ):
                raise ValueError(f"api_keys_file: keys[{index}].adapters must be a list of names")
            keys.append(entry["key"])
            adapters.append(None if allowed is None else frozenset(allowed))
        if not keys:
            raise ValueError(f"api_keys_file: {path} holds no key")
        return cls(keys, adapters)

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
        return Principal(found, self._adapters[found]) if found >= 0 else None
