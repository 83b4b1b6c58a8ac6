"""The churn benchmark's pieces: floors measured on this machine, adapter files on disk, and an asyncio client
that drives AsyncEngine the way the HTTP server does (one task per request, streaming)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save

from loraplane.engine.core.sequence import SamplingParams
from loraplane.engine.lora.safetensors_io import read_file, read_file_direct
from loraplane.engine.lora.weights import TARGET_MODULES, module_shapes

PARENT = {m: "self_attn" if m[0] in "qkvo" else "mlp" for m in TARGET_MODULES}


def drop_page_cache(allowed: bool = True) -> bool:
    """Write back and drop the page cache (needs root and a writable /proc/sys); False when not allowed.
    ``allowed`` False (a shared machine, --quick): never touch it."""
    if not allowed:
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def measure_floors(b) -> dict:
    """Disk (O_DIRECT, or a read after dropping the cache), page cache and pinned host-to-device bandwidth."""
    size = (64 << 20) if b.quick else (2 << 30)
    path = b.tmp / "floor.bin"
    block = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dropped = drop_page_cache(not b.quick)
    t = time.perf_counter()
    try:
        read_file_direct(path) if not dropped else read_file(path)
        disk_s, direct = time.perf_counter() - t, True
    except OSError:  # no O_DIRECT on this file system
        disk_s, direct = None, False
    read_file(path)
    t = time.perf_counter()
    read_file(path)
    cache_s = time.perf_counter() - t
    pcie = size / cache_s
    if b.device.type == "cuda":
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(size, dtype=torch.uint8, device=b.device)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        pcie = 3 * size / (start.elapsed_time(end) / 1e3)
        del host, dev
    path.unlink()
    return {"disk_gbs": size / (disk_s or cache_s) / 1e9, "page_cache_gbs": size / cache_s / 1e9,
            "pcie_gbs": pcie / 1e9, "page_cache_dropped": dropped, "o_direct": direct}  # fmt: skip


def write_adapter_files(
    b, root: Path, ranks: dict[str, int], drop: bool, link: bool = False
) -> dict[str, Path]:
    """One PEFT folder per name (lora_alpha = 2r, every module); contents built once per rank. Each folder
    gets its own file, or with ``link`` a hard link to one file per rank (the same inode: the page cache
    serves every read after the first)."""
    shapes, blobs, out = module_shapes(b.cfg), {}, {}
    gen = torch.Generator(device=b.device).manual_seed(0)
    for rank in sorted(set(ranks.values())):
        tensors = {}
        for m in TARGET_MODULES:
            fan_in, fan_out = shapes[m]
            for layer in range(b.cfg.num_layers):
                p = f"base_model.model.model.layers.{layer}.{PARENT[m]}.{m}"
                a = torch.randn(rank, fan_in, generator=gen, device=b.device) * fan_in**-0.5
                tensors[f"{p}.lora_A.weight"] = a.to(b.dtype).cpu()
                tensors[f"{p}.lora_B.weight"] = (
                    (torch.randn(fan_out, rank, generator=gen, device=b.device) * 0.01).to(b.dtype).cpu()
                )
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
                  "bias": "none"}  # fmt: skip
        blobs[rank] = (save(tensors), json.dumps(config))
    first: dict[int, Path] = {}
    for name, rank in ranks.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        weights = folder / "adapter_model.safetensors"
        if link and rank in first:
            os.link(first[rank], weights)
        else:
            weights.write_bytes(blobs[rank][0])
            first[rank] = weights
        (folder / "adapter_config.json").write_text(blobs[rank][1])
        out[name] = folder
    if drop:
        drop_page_cache(not b.quick)
    return out


async def first_token_ms(engine, prompt: list[int], adapter: str | None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start, first = time.perf_counter(), None
    async for _ in engine.add_request(prompt, params, adapter=adapter):
        first = first or (time.perf_counter() - start) * 1e3
    return first


async def serve_trace(engine, arrivals, prompts, lens_out, adapters, tier_of=None) -> dict:
    """Each request submitted at its arrival time; tokens/s over the span, TTFT and inter-token percentiles;
    with ``tier_of(key)``, each request's TTFT under the tier its adapter was on when it arrived."""
    t0 = time.perf_counter()
    ttft, itl, ends, failed = [], [], [], 0
    total, timeline = 0, []
    by_tier: dict[str, list[float]] = {}

    async def one(i: int) -> None:
        nonlocal total, failed
        await asyncio.sleep(max(0.0, t0 + float(arrivals[i]) - time.perf_counter()))
        params = SamplingParams(temperature=0.0, max_tokens=int(lens_out[i]), ignore_eos=True)
        tier = (tier_of(adapters[i]) if adapters[i] else "base") if tier_of else None
        start = last = time.perf_counter()
        try:
            async for out in engine.add_request(prompts[i], params, adapter=adapters[i]):
                now = time.perf_counter()
                if last == start:
                    timeline.append((round(start - t0, 3), round(now - start, 3)))  # (arrival s, TTFT s)
                    if tier is not None:
                        by_tier.setdefault(tier, []).append(round((now - start) * 1e3, 1))
                (itl if last != start else ttft).append(now - last)
                last = now
                total += len(out.new_token_ids)
        except Exception:  # noqa: BLE001 - counted: a benchmark reports failures, it does not stop on them
            failed += 1
        ends.append(last)

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    span = max(ends) - (t0 + float(arrivals[0]))
    ttft_ms, itl_ms = np.array(ttft) * 1e3, np.array(itl or [0.0]) * 1e3
    return {"tok_s": total / span, "seconds": span, "failed": failed,
            "ttft_p50_ms": float(np.percentile(ttft_ms, 50)), "ttft_p99_ms": float(np.percentile(ttft_ms, 99)),
            "itl_p50_ms": float(np.percentile(itl_ms, 50)), "itl_p99_ms": float(np.percentile(itl_ms, 99)),
            "distinct": len({a for a in adapters if a}), "timeline": sorted(timeline),
            **({"ttft_by_tier_ms": {t: sorted(v) for t, v in by_tier.items()}} if tier_of else {})}  # fmt: skip
