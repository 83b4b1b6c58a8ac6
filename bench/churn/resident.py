"""Resident decode while adapters load: the background batch's tokens/s over a window without loads, one in
which cold adapters are only loaded (disk -> host -> GPU, no request: what a prefetch costs), and one in
which each cold adapter also serves a 64-token request (its load plus its prefill). A window with loads is
compared with windows without loads just before and just after it (the background contexts grow, so the rate
without loads drifts down over the run). With CHURN_PROFILE=DIR
each window is also profiled (torch.profiler; GPU kernels and host ops, DIR/<case>.txt)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import torch
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
    rows, arena = [], manager.arena if manager is not None else None

    async def measured(action, case: str) -> tuple[float, float, float, list[str]]:
        """(tokens/s of the background batch, window start, window end, the keys loaded) over one window."""
        keys, profiler = [], start_profile(case) if action is not None else None
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < window:
            if action is not None:
                keys.append(await action())
            await asyncio.sleep(1 / LOADS_PER_S)
        t1 = time.perf_counter()
        if profiler is not None:
            dump_profile(profiler, case)
        return sum(t0 <= t < t1 for t in tokens) / (t1 - t0), t0, t1, keys

    async def landed(keys: list[str]) -> None:
        deadline = time.perf_counter() + 20
        while keys and time.perf_counter() < deadline and any(manager.tier_of(k) != "gpu" for k in keys):
            await asyncio.sleep(0.05)  # the window's loads land before the next window starts

    for case, action, use_arena in cases:
        if manager is not None:
            manager.arena = arena if use_arena else None  # None: each parse pins its own buffer (as before)
        compiled = triton_compiled()
        if action is None:
            tok_s, t0, t1, keys = await measured(None, case)
            ratio, around = 1.0, {}
        else:
            # The background requests' contexts grow by a token a step, so a later window is slower by itself:
            # the reference is the rate without loads interpolated, from windows just before and just after,
            # to the middle of the window with loads.
            before, b0, b1, _ = await measured(None, case)
            tok_s, t0, t1, keys = await measured(action, case)
            await landed(keys)
            after, a0, a1, _ = await measured(None, case)
            mid_b, mid, mid_a = (b0 + b1) / 2, (t0 + t1) / 2, (a0 + a1) / 2
            reference = before + (after - before) * (mid - mid_b) / (mid_a - mid_b)
            # A bracket with no token means the background batch ended (max_tokens) around the window: no
            # reference then, rather than a rate interpolated towards zero.
            ratio = tok_s / reference if before and after else None
            around = {
                "no_loads_before_tok_s": before,
                "no_loads_after_tok_s": after,
                "reference_tok_s": reference,
            }
        row = {"case": f"{label} resident decode, {case}", "section": "decode", "tok_s": tok_s,
               "vs_no_loads": ratio, **around, "loads": len(keys), **clock.window(t0, t1),
               "triton_compiles": triton_compiled() - compiled}  # fmt: skip
        if keys:
            row["loaded_to_gpu"] = sum(manager.tier_of(k) == "gpu" for k in keys)
            row["arena_misses"] = manager.arena_misses
            row["arena_pinned"] = bool(manager.arena is not None and manager.arena.pinned)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if manager is not None:
        manager.arena = arena
    return rows


def start_profile(case: str):
    """With CHURN_PROFILE=DIR, a torch.profiler over the window of every case (GPU and engine-thread time)."""
    if not os.environ.get("CHURN_PROFILE") or not torch.cuda.is_available():
        return None
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    prof.__enter__()
    return prof


def dump_profile(prof, case: str) -> None:
    torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    out = Path(os.environ["CHURN_PROFILE"])
    out.mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() else "-" for c in case)[:60]
    table = prof.key_averages()
    text = table.table(sort_by="cuda_time_total", row_limit=30) + "\n\n"
    text += table.table(sort_by="cpu_time_total", row_limit=30)
    (out / f"{name}.txt").write_text(text)


async def _drain(stream) -> None:
    async for _ in stream:
        pass
