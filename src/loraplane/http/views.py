"""What ``GET /admin/adapters`` shows of each adapter version: the admin side's AdapterRegistry entry (source, phase,
timings, last error) merged with the engine's truth (state, tier, bytes, serving)."""

from __future__ import annotations

from loraplane.engine.api import AdapterInfo, adapter_key
from loraplane.http.adapters import CACHED, FAILED, PULLING, Entry


def adapter_views(infos: list[AdapterInfo], entries: dict[str, Entry]) -> list[dict]:
    by_key = {info.key: info for info in infos}
    views = []
    for key in sorted(set(by_key) | set(entries)):
        info, entry = by_key.get(key), entries.get(key)
        views.append(_view(info, entry))
    return views


def _view(info: AdapterInfo | None, entry: Entry | None) -> dict:
    name, version = (info.name, info.version) if info else (entry.spec.name, entry.spec.version)
    timings: dict[str, float] = {}
    if entry is not None:
        timings.update(entry.timings)
    if info is not None:
        timings = {**{k: round(v, 6) for k, v in info.timings.items()}, **timings}
    error = None
    if entry is not None and entry.error is not None:
        error = {"reason": entry.error.reason, "message": entry.error.message}
    elif info is not None and info.error:
        error = {"reason": "EngineError", "message": info.error}
    if entry is not None and (info is None or entry.state in (PULLING, CACHED, FAILED)):
        state = entry.state  # before the engine holds it, or after a failed attempt
    else:
        state = info.state
    return {
        "name": name,
        "version": version,
        "key": adapter_key(name, version),
        "digest": (info.digest if info else None) or (entry.digest or entry.spec.digest or ""),
        "state": state,
        "serving": bool(info and info.serving),
        "message": error["message"] if error else "",
        "error": error,
        "tier": info.tier if info else None,
        "bytes": info.bytes if info else 0,
        "rank": info.rank if info else None,
        "pinned": info.pinned if info else bool(entry and entry.spec.pin),
        "in_flight": info.in_flight if info else 0,
        "uri": entry.spec.uri if entry else None,
        "timings": timings,
    }
