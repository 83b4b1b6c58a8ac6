"""Host time of an eager LoRA step, launches left out: what the plans and their arguments cost the CPU.

The engine's layout on the Llama-3-8B shape (probe.py's pools, one r16 all-module adapter), 32 layers x 4
ops on the CPU, each FastLaunch call replaced by a counter: the time is the launch plans (one per op and
step), the launch configs (``pick_config``, per call in probe.Step) and the per-layer arguments, not the
launches themselves (a direct launch adds the C launcher's few microseconds each; one through Triton's
binding, tens). Compare with the churn bench's per-sample ``launches`` counts.

Then the same step through the engine's entry points (``lora_apply_many`` for the packed projections,
``lora_apply`` for the others), launches left out; and the launches' own Python: the same step's
launches, each through ``FastLaunch.__call__``'s direct path with its launcher replaced by a function that
does nothing (what a launch costs the CPU before the C launcher's few microseconds).

    PYTHONPATH=src python bench/lora_decode/host_cost.py
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
from probe import OPS, SHAPES, Step, ranks_of

from loraplane.kernels import LoRABatchMeta, LoRAPool, ModuleSpec, fast_launch, lora_apply, lora_apply_many

CASES = {"prefill T=256, 1 adapter": (256, [(0, 256)]), "64 tokens, 1 adapter": (64, [(0, 1)] * 64)}


def small_pools(dev) -> dict[str, LoRAPool]:
    """One r16 adapter in every module's pool (room for a few: the host cost does not depend on it)."""
    pools = {}
    for m, (i, o) in SHAPES.items():
        spec = {m: ModuleSpec(i, (o,))}
        page = LoRAPool.page_bytes_for(spec, 32, 1, torch.bfloat16)
        p = LoRAPool(spec, 32, 40 * page, page_rank=1, max_rank=64, max_adapters=8, dtype=torch.bfloat16,
                     device=dev)  # fmt: skip
        p.allocate(16, 1.0, slot=0)
        pools[m] = p
    return pools


def direct_path_ms(calls: list[tuple]) -> float:
    """Median ms over 7 runs of ``calls`` ((FastLaunch, args) of one step) through the direct path, each
    launch adopted with a launcher that does nothing."""
    fast_launch._current_stream = lambda device: 0  # this process only: there is no stream

    def noop(*call) -> None:
        return None

    kernel = SimpleNamespace(function=object(), packed_metadata=object())
    launches = []
    for launch, args in calls:
        fresh = fast_launch.FastLaunch(launch.fn, launch.grid, launch.constexprs, **launch.options)
        fresh._adopt(
            kernel, noop, (1, 1, 1, 0, kernel.function, kernel.packed_metadata, None, None, None, *args), args
        )
        launches.append((fresh, args))
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for fresh, args in launches:
            fresh(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def entry_points_ms(pools, meta, tokens: int) -> float:
    """Median ms over 7 runs of one eager step through the engine's entry points, launches left out: per
    layer ``lora_apply_many`` for q,k,v and gate,up (one launch pair each) and ``lora_apply`` for o and down,
    as ``LoRALinear`` calls them."""
    xs = {op: torch.zeros(tokens, SHAPES[OPS[op][0]][0], dtype=torch.bfloat16) for op in OPS}
    ys = {op: torch.zeros(tokens, sum(SHAPES[m][1] for m in OPS[op]), dtype=torch.bfloat16) for op in OPS}
    calls = []
    for op, mods in OPS.items():
        if len(mods) > 1:
            starts = [sum(SHAPES[m][1] for m in mods[:i]) for i in range(len(mods))]
            targets = [(pools[m], m, c) for m, c in zip(mods, starts, strict=True)]
            calls.append(lambda layer, op=op, t=targets: lora_apply_many(ys[op], xs[op], t, layer, meta,
                                                                        backend="triton"))  # fmt: skip
        else:
            calls.append(lambda layer, op=op, m=mods[0]: lora_apply(ys[op], xs[op], pools[m], layer, m, meta,
                                                                    backend="triton"))  # fmt: skip
    times = []
    for _ in range(8):
        meta.plans = {}  # a new step: the first layer builds the plans
        start = time.perf_counter()
        for layer in range(32):
            for call in calls:
                call(layer)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def main() -> None:
    launches = [0]
    calls: list[tuple] = []
    real_call = fast_launch.FastLaunch.__call__

    def counted(self, *args) -> None:
        launches[0] += 1
        calls.append((self, args))

    fast_launch.FastLaunch.__call__ = counted  # this process only: nothing is launched
    dev = torch.device("cpu")
    pools = small_pools(dev)
    ranks = ranks_of(pools)
    for name, (tokens, reqs) in CASES.items():
        times = []
        for _ in range(7):
            meta = LoRABatchMeta(tokens, dev, tile_m=16, capture=False, max_rank=64).build(reqs, ranks)
            step = Step(pools, meta, dev)
            step.x = {op: torch.zeros(tokens, SHAPES[OPS[op][0]][0], dtype=torch.bfloat16) for op in OPS}
            step.y = {op: torch.zeros(tokens, sum(SHAPES[m][1] for m in OPS[op]), dtype=torch.bfloat16)
                      for op in OPS}  # fmt: skip
            launches[0] = 0
            calls.clear()
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        print(
            f"{name}: {statistics.median(times):.2f} ms host a step (median of 7), {launches[0]} launches left out"
        )
        fast_launch.FastLaunch.__call__ = real_call
        print(
            f"  its {len(calls)} launches through the direct path: {direct_path_ms(calls):.2f} ms (median of 7)"
        )
        fast_launch.FastLaunch.__call__ = counted
        print(
            f"  the same step through lora_apply_many / lora_apply: {entry_points_ms(pools, meta, tokens):.2f} ms"
        )


if __name__ == "__main__":
    main()
