"""Resident decode while adapters load: the background batch's tokens/s over a window without loads, one in
which cold adapters are only loaded (disk -> host -> GPU, no request: what a prefetch costs), and one in
which each cold adapter also serves a 64-token request (its load plus its prefill)."""

from __future__ import annotations

import asyncio
import json
import time

from probes import StepClock, triton_compiled

from loraplane.engine.core.sequence import SamplingParams

LOADS_PER_S = 10


async def decode_under_loads(
    b, engine, label: str, tokens: list[float], cold, clock: StepClock
) -> list[dict]:
    window = 1.0 if b.quick else 2.0
    manager = engine.engine.runner.lora if cold is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def prefetch() -> str:
        key = await cold("disk")
        await engine._on_engine_thread(lambda: manager.request(key))
        return key

    async def with_request() -> str:
        key = await cold("disk")
        asyncio.get_running_loop().create_task(
            _drain(engine.add_request(list(range(1, 65)), params, adapter=key))
        )
        return key

    cases = [("no loads", None, True)]
    if cold is not None:
        cases += [(f"{LOADS_PER_S} cold loads/s, no requests", prefetch, True),
                  (f"{LOADS_PER_S} cold loads/s, no requests, a new page-locked buffer per load", prefetch, False),
                  (f"{LOADS_PER_S} cold loads/s with a request each", with_request, True)]  # fmt: skip
    rows, quiet, arena = [], None, manager.arena if manager is not None else None
    for case, action, use_arena in cases:
        if manager is not None:
            manager.arena = arena if use_arena else None  # None: each parse pins its own buffer (as before)
        compiled, keys = triton_compiled(), []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < window:
            if action is not None:
                keys.append(await action())
            await asyncio.sleep(1 / LOADS_PER_S)
        t1 = time.perf_counter()
        tok_s = sum(t0 <= t < t1 for t in tokens) / (t1 - t0)
        quiet = quiet or tok_s
        row = {"case": f"{label} resident decode, {case}", "section": "decode", "tok_s": tok_s,
               "vs_no_loads": tok_s / quiet if quiet else None, "loads": len(keys), **clock.window(t0, t1),
               "triton_compiles": triton_compiled() - compiled}  # fmt: skip
        deadline = time.perf_counter() + 20
        while keys and time.perf_counter() < deadline and any(manager.tier_of(k) != "gpu" for k in keys):
            await asyncio.sleep(0.05)  # the window's loads land before the next window starts
        if keys:
            row["loaded_to_gpu"] = sum(manager.tier_of(k) == "gpu" for k in keys)
            row["arena_misses"] = manager.arena_misses
            row["arena_pinned"] = bool(manager.arena is not None and manager.arena.pinned)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if manager is not None:
        manager.arena = arena
    return rows


async def _drain(stream) -> None:
    async for _ in stream:
        pass
