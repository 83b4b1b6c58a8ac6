"""Bearer credentials: one parsing rule for both ports, and the tenants' API keys, read from a file.

``bearer_token`` is the one rule (RFC 7235: the scheme is case-insensitive; one or more spaces before the
token). Two keys-file formats: plain text (one key per line, ``#`` comments; each key may use everything),
or the ``api-keys.yaml`` that the operator mounts from the LoRABase's apiKeysSecretRef::

    keys:
      - key: <secret>
        name: support-team          # a label for logs and metrics (default: key-<index>)
        adapters: [support-*, faq]  # adapter names or globs (fnmatch); absent: every adapter
        base: false                 # may call the base model itself (default: true)
        max_concurrency: 4          # requests in flight at once (default: unlimited)
        tokens_per_minute: 20000    # prompt + completion tokens in any 60 s (default: unlimited)

Only SHA-256 digests of the keys are kept after loading, and no key ever reaches a log line or a repr.
Comparing digests of equal length keeps the comparison's time independent of the key's length too.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

_BEARER = re.compile(r"bearer +(\S+) *", re.IGNORECASE)
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme in any case), else None."""
    match = _BEARER.fullmatch(authorization or "")
    return match.group(1) if match else None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling, without the secret: what its key may use and how much."""

    key_index: int  # the key's place among the file's keys
    name: str = ""  # the label from the keys file (logs, metrics); never the key
    adapters: tuple[str, ...] | None = None  # names or globs; None: every adapter
    base: bool = True  # may call the base model
    max_concurrency: int | None = None
    tokens_per_minute: int | None = None

    def may_use(self, adapter_name: str | None) -> bool:
        """``adapter_name`` None is the base model."""
        if adapter_name is None:
            return self.base
        if self.adapters is None:
            return True
        return any(fnmatch.fnmatchcase(adapter_name, pattern) for pattern in self.adapters)


OPEN = Principal(key_index=-1, name="anonymous")  # the caller of a server without keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    __slots__ = ("_digests", "_principals")

    def __init__(self, keys: list[str], principals: list[Principal] | None = None) -> None:
        keys = [k.strip() if isinstance(k, str) else "" for k in keys]
        if not keys or any(not k for k in keys):
            raise ValueError("api_keys: need at least one non-empty key")
        if any(any(c.isspace() for c in k) for k in keys):
            raise ValueError("api_keys: a key must not contain whitespace")
        if principals is None:
            principals = [Principal(i, f"key-{i}") for i in range(len(keys))]
        self._digests = tuple(_digest(k) for k in keys)
        self._principals = tuple(principals)

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
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:  # its message may quote a line, so a key: name only its kind
            raise ValueError(f"api_keys_file: {path} is not valid YAML ({type(exc).__name__})") from None
        entries = loaded.get("keys") if isinstance(loaded, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"api_keys_file: {path} holds no key (`keys` must be a non-empty list)")
        keys, principals = [], []
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
                raise ValueError(f"api_keys_file: keys[{index}] needs a string `key`")
            keys.append(entry["key"])
            principals.append(_principal(index, entry))
        return cls(keys, principals)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys)"

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The caller behind an ``Authorization: Bearer <key>`` header, or None."""
        presented = bearer_token(authorization)
        if presented is None:
            return None
        digest = _digest(presented)
        found = -1
        for index, known in enumerate(self._digests):  # no early exit: every key is compared
            if hmac.compare_digest(digest, known):
                found = index
        return self._principals[found] if found >= 0 else None


RESERVED_NAMES = frozenset({"other", "anonymous"})
_FIELDS = {"key", "name", "adapters", "base", "max_concurrency", "tokens_per_minute"}


def _principal(index: int, entry: dict) -> Principal:
    where = f"api_keys_file: keys[{index}]"
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown field (known: {sorted(_FIELDS)})")
    name = entry.get("name", f"key-{index}")
    if not isinstance(name, str) or not _LABEL.fullmatch(name):
        raise ValueError(f"{where}.name: must be 1-63 letters, digits, '.', '_' or '-'")
    if name in RESERVED_NAMES:  # metering folds rare tenants into `other`; `anonymous` is the keyless caller
        raise ValueError(f"{where}.name: {name!r} is reserved (metrics use it); choose another")
    adapters = entry.get("adapters")
    if adapters is not None and not (
        isinstance(adapters, list) and all(isinstance(a, str) and a for a in adapters)
    ):
        raise ValueError(f"{where}.adapters: must be a list of adapter names or globs")
    base = entry.get("base", True)
    if not isinstance(base, bool):
        raise ValueError(f"{where}.base: must be true or false")
    limits = {}
    for field in ("max_concurrency", "tokens_per_minute"):
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}.{field}: must be a positive integer")
        limits[field] = value
    return Principal(index, name, None if adapters is None else tuple(adapters), base, **limits)
