"""The adapter commands of ``AsyncEngine``: load, warm, alias, pin, unload and lease adapter versions.

``AdapterCommands`` is a base of ``AsyncEngine`` (async_engine.py), which keeps the request streams, the read-only
views and the loop. Any thread may call these; what touches the device is handed to the engine thread as a
``_Call`` through the engine's command queue (``_cond``, ``_commands``), so only that thread ever does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplane.engine.api import AdapterError, AdapterInfo, AdapterLease, RemoteAdapter, adapter_key

if TYPE_CHECKING:
    from loraplane.engine.core.llm_engine import LLMEngine


@dataclass(slots=True)
class _Call:
    """A function to run on the engine thread (adapter management); its result goes to ``future``."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


class AdapterCommands:
    """Adapter management over the engine thread's command queue; a base of ``AsyncEngine``."""

    engine: LLMEngine

    def lease_adapter(self, key: str) -> AdapterLease:
        """Keep ``key`` registered until the lease is released (AdapterError('AdapterNotFound') if it takes no
        requests now): the later parts of one request start on the version its first part got."""
        lora = self._lora("adapter")
        lora.hold(key)
        return AdapterLease(key, lambda: self._let_go(lora, key))

    def _let_go(self, lora, key: str) -> None:
        """A lease's end (any thread, the collector's too): count it out, and have the engine thread free the
        version now if its unload waits on nothing else (an idle engine runs no step that would)."""
        lora.note_request(key, -1)
        with self._cond:
            if not self._closed:
                self._commands.append(_Call(lora.poll, concurrent.futures.Future()))
                self._cond.notify()

    async def load_adapter(self, name: str, version: str, folder: Path, digest: str, *, pin: bool = False,
                           expected_base_hash: str | None = None, on_disk: bool = False) -> AdapterInfo:  # fmt: skip
        """Parse and validate a verified PEFT folder into the host tier (AdapterError on refusal).
        ``on_disk``: register it from its config and header alone; it loads when a request needs it.
        Idempotent per name@version and digest; another digest under the same name@version is a conflict."""
        lora = self._lora("adapter")
        self._check_base(name, version, expected_base_hash)
        registered = lora.is_registered(adapter_key(name, version))
        if not registered and on_disk:
            return await asyncio.to_thread(
                lora.register_on_disk, name, version, Path(folder), digest, pin=pin
            )
        if not registered:
            start = time.perf_counter()
            weights = await asyncio.to_thread(lora.parse, Path(folder))
            await asyncio.to_thread(weights.digest)  # its hash may still run: never wait on the event loop
            return lora.register(name, version, Path(folder), digest, weights, pin=pin,
                                 load_s=time.perf_counter() - start)  # fmt: skip
        return lora.register(name, version, Path(folder), digest, None, pin=pin)

    async def register_remote_adapter(self, name: str, version: str, digest: str, remote: RemoteAdapter, *,
                                      pin: bool = False, expected_base_hash: str | None = None) -> AdapterInfo:  # fmt: skip
        """Register a version whose files are not on this node (its ranks from the verified manifest);
        ``remote.fetch`` runs on a loader worker when a request or a warm-up first needs it. Idempotent per
        name@version and digest, like ``load_adapter``."""
        lora = self._lora("adapter")
        self._check_base(name, version, expected_base_hash)
        return lora.register_remote(name, version, digest, remote, pin=pin)

    def _check_base(self, name: str, version: str, expected_base_hash: str | None) -> None:
        base = self.engine.runner.base_hash
        if expected_base_hash is not None and expected_base_hash != base:
            raise AdapterError(
                "BaseMismatch",
                f"{name}@{version}: built for base {expected_base_hash}, this engine serves {base}",
            )

    async def warm_adapter(self, name: str, version: str, *, gpu: bool = True,
                           only_if_room: bool = False) -> AdapterInfo:  # fmt: skip
        """Make it GPU-resident and run one real forward through it (finite logits, else WarmFailed).
        ``only_if_room``: skip it (it stays on its tier, loaded on demand) unless the pools have free room.
        A disk or remote version is read (or pulled) on a loader worker first, while the engine serves on
        (``only_if_room``, a start-up warm-up, asks the engine thread about room first and reads there)."""
        lora, key = self._lora("adapter"), adapter_key(name, version)
        lora.get(key)
        if gpu and not only_if_room:
            loading = lora.prefetch(key)
            if loading is not None:  # its outcome is the warm-up's: the engine thread reads it below
                await asyncio.to_thread(concurrent.futures.wait, [loading])

        def warm() -> AdapterInfo:
            if gpu and not (only_if_room and not lora.has_room_for(key)):
                return self.engine.warm_adapter(key)
            lora.get(key)  # AdapterNotFound once it is unloading
            return lora.info(key)

        return await self._on_engine_thread(warm)

    async def set_alias(self, name: str, version: str) -> None:
        """Route ``name`` to ``version`` in one step; requests already admitted keep the version they have."""
        self._lora("adapter").set_alias(name, version)

    async def unload_adapter(self, name: str, version: str | None = None) -> list[str]:
        """Stop taking requests for the version(s) now; weights are freed once in-flight requests finish."""
        lora = self._lora("adapter")
        keys = lora.mark_unloading(name, version)
        await self._on_engine_thread(lora.poll)
        return keys

    async def pin_adapter(self, name: str, version: str, pinned: bool) -> AdapterInfo:
        return self._lora("adapter").set_pinned(adapter_key(name, version), pinned)

    def _lora(self, need: str | None):
        lora = self.engine.adapters
        if lora is None and need is not None:
            raise AdapterError(
                "UnsupportedAdapter", f"{need}: this engine serves no adapters (EngineConfig.enable_lora)"
            )
        return lora

    def _on_engine_thread(self, fn: Callable[[], Any]):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._raise_if_dead()
            self._commands.append(_Call(fn, future))
            self._cond.notify()
        return asyncio.wrap_future(future)

    def _note_request(self, key: str, delta: int) -> None:
        lora = self._lora(None)
        if lora is not None:
            lora.note_request(key, delta)


def _run_call(call: _Call) -> None:
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        call.future.set_result(call.fn())
    except Exception as error:  # noqa: BLE001 - an admin command's failure belongs to its caller
        call.future.set_exception(error)
