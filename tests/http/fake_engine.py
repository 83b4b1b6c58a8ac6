"""The adapter half of the engine surface (docs: ENGINE_API), as bookkeeping over the real base engine.

Used only while the AsyncEngine in this tree lacks the adapter methods: requests for an adapter run on the
base weights, so the HTTP side (routing, admin, keys, metrics) is tested end to end, but adapter outputs are
not. ``engine_class()`` picks the real AsyncEngine as soon as it has them.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from loraplane.server.engine.api import AdapterError, AdapterInfo, EngineInfo, StepStats, adapter_key
from loraplane.server.engine.async_engine import AsyncEngine

REAL_ADAPTERS = hasattr(AsyncEngine, "load_adapter")


class BookkeepingEngine(AsyncEngine):
    def __init__(self, engine) -> None:
        self._book: dict[str, AdapterInfo] = {}
        self._alias: dict[str, str] = {}
        self._listeners = []
        inner_step = engine.step

        def step():
            outputs = inner_step()
            stats = engine.stats()
            used = stats.num_kv_blocks - stats.num_free_kv_blocks
            adapters = len({a.key for a in self._book.values() if a.in_flight})
            for fn in self._listeners:
                fn(
                    StepStats(
                        len(outputs), stats.num_running, adapters, used, stats.num_kv_blocks, 0, 1 << 20
                    )
                )
            return outputs

        engine.step = step
        super().__init__(engine)

    def info(self) -> EngineInfo:
        runner = self.engine.runner
        return EngineInfo(runner.base_hash, self.engine.max_model_len, int(getattr(runner, "vocab_size", 128)), 64,
                          ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                          "cpu", "float32")  # fmt: skip

    def adapters(self) -> list[AdapterInfo]:
        return [replace(a, serving=self._alias.get(a.name) == a.version) for a in self._book.values()]

    def resolve(self, name: str) -> str | None:
        version = self._alias.get(name)
        return adapter_key(name, version) if version is not None else None

    def tier_of(self, key: str) -> str | None:
        info = self._book.get(key)
        return info.tier if info else None

    def add_step_listener(self, fn) -> None:
        self._listeners.append(fn)

    async def load_adapter(
        self, name, version, folder: Path, digest: str, *, pin=False, expected_base_hash=None
    ):
        await asyncio.sleep(0)
        key = adapter_key(name, version)
        old = self._book.get(key)
        if old is not None:
            if old.digest != digest:
                raise AdapterError("AdapterConflict", f"{key} is loaded with digest {old.digest}")
            return old
        folder = Path(folder)
        weights = folder / "adapter_model.safetensors"
        if not (folder / "adapter_config.json").is_file() or not weights.is_file():
            raise AdapterError(
                "BadAdapterFile", f"{folder}: needs adapter_config.json and adapter_model.safetensors"
            )
        info = AdapterInfo(name, version, digest, "loaded", "host", pin, False, weights.stat().st_size, 4, 0,
                           {"load": 0.001})  # fmt: skip
        self._book[key] = info
        return info

    async def warm_adapter(self, name, version, *, gpu=True):
        key = adapter_key(name, version)
        if key not in self._book:
            raise AdapterError("AdapterNotFound", f"{key} is not loaded")
        await asyncio.sleep(0.01)
        info = self._book[key] = replace(self._book[key], state="warm", tier="gpu" if gpu else "host",
                                         timings={**self._book[key].timings, "warm": 0.01})  # fmt: skip
        return info

    async def set_alias(self, name, version) -> None:
        if adapter_key(name, version) not in self._book:
            raise AdapterError("AdapterNotFound", f"{name}@{version} is not loaded")
        self._alias[name] = version

    async def unload_adapter(self, name, version=None) -> list[str]:
        keys = [k for k, a in self._book.items() if a.name == name and version in (None, a.version)]
        for key in keys:
            info = self._book.pop(key)
            if self._alias.get(name) == info.version:
                del self._alias[name]
        return keys

    async def pin_adapter(self, name, version, pinned: bool):
        key = adapter_key(name, version)
        if key not in self._book:
            raise AdapterError("AdapterNotFound", f"{key} is not loaded")
        self._book[key] = replace(self._book[key], pinned=pinned)
        return self._book[key]

    def add_request(self, prompt_token_ids, sampling=None, request_id=None, adapter=None):
        if adapter is not None and adapter not in self._book:
            raise AdapterError("AdapterNotFound", f"{adapter} is not loaded")
        return super().add_request(prompt_token_ids, sampling, request_id, None)


def engine_class():
    return AsyncEngine if REAL_ADAPTERS else BookkeepingEngine
