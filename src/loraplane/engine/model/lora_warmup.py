"""Compile the eager LoRA launches at start, before the first requests with adapters need them.

A prefill, mixed or uncaptured decode step with adapters picks its shrink and expand launch shapes per step
(``kernels.launch_config.pick_config``): the rank class of its adapters and its tile count decide the
compile-time constants. Triton compiles each new combination on first use, on the engine thread, for a
fraction of a second to a second each: under adapter churn, the first steps of every new rank and size class
stall every tenant (tens of compilations when ranks 8 to 64 and prompts of every length arrive at once).

The warm-up runs one forward per step kind, rank class, tile-count class and module family, no KV written,
with the LoRA metadata of requests on free pool slots: the metadata builder sees the class's rank, while the
device's rank table says 0 for a free slot, so the kernels compile and launch but read and write nothing.
Each runs twice: GEMM first, then delta first (the storing expand of steps whose every row has an adapter).

A Llama-3-8B engine compiles about 150 such kernels, a fifth of a second to a second each. Compiling is
CPU work that mostly runs outside the GIL, so the forwards first run once with the LoRA launches only
listing their shapes (``fast_launch.compile_only``), those compile side by side on a pool of threads
(``compile_queued``), and then the forwards run for real, finding every kernel compiled.
"""

from __future__ import annotations

import logging
import os

import torch

from loraplane.engine.model.attention import AttentionMetadata, PrefillSpan
from loraplane.kernels.fast_launch import compile_only, compile_queued
from loraplane.kernels.launch_config import FEW_TILES, num_sms, prefill_split_bounds

log = logging.getLogger(__name__)

# pick_config's rank classes: its rank tile (block_r) is 16, 32 or 64 rows; larger ranks loop 64-row tiles.
RANK_CLASSES = (16, 32, 64)


def rank_classes(max_rank: int) -> list[int]:
    """One rank per rank class that adapters of at most ``max_rank`` can fall in."""
    out = []
    for top in RANK_CLASSES:
        out.append(min(top, max_rank))
        if top >= max_rank:
            break
    return out


def tile_counts(max_tiles: int, bounds: tuple[int, ...] = ()) -> list[int]:
    """Tile counts at which to warm: the powers of two up to ``max_tiles``, ``max_tiles``, the first
    count past decode's few-tiles split of K, and each of ``bounds`` (a prefill's split classes begin there,
    ``prefill_split_bounds``) with the count below it.

    For widths that are multiples of 16, pick_config's column chunk doubles as the tile count about doubles:
    each of its classes is an interval [a, b) of tile counts with b >= 2a - 1 (integer division), cut at the
    largest possible one, so it holds a power of two or that largest count. (Widths that are not are
    masked tensor-parallel shards, whose engines do not warm.) The split of K changes once, after FEW_TILES;
    a class that spans that step holds FEW_TILES (a power of two) below it and FEW_TILES + 1 above it."""
    counts, t = set(), 1
    while t < max_tiles:
        counts.add(t)
        t *= 2
    counts |= {c for c in (FEW_TILES + 1, max_tiles) if 1 <= c <= max_tiles}
    # The split classes cut the column-chunk classes: a piece at a class's edge holds its first count b or
    # the count below the next class's first; any other piece is a whole chunk class, warmed above.
    counts |= {c for b in bounds for c in (b - 1, b) if 1 <= c <= max_tiles}
    return sorted(counts)


def requests_for_tiles(
    tiles: int, tile_m: int, free_slots: list[int], capacity: int
) -> list[tuple[int, int]]:
    """(slot, tokens) requests whose metadata has exactly ``tiles`` tiles of ``tile_m`` rows, using as few
    tokens as the free slots allow (one-token groups, one tile each, then one long group); [] if the
    metadata's token capacity cannot hold them."""
    groups = min(tiles, len(free_slots))
    if groups == 0:
        return []
    last = (tiles - groups) * tile_m + 1  # tokens for the last group's tiles - groups + 1 tiles
    reqs = [(slot, 1) for slot in free_slots[: groups - 1]] + [(free_slots[groups - 1], last)]
    return reqs if sum(n for _, n in reqs) <= capacity else []


def max_tiles(capacity: int, tile_m: int, slots: int) -> int:
    """The most tiles one step can have: one-token groups on all slots but one, the rest in one group."""
    groups = min(slots, capacity)
    return 0 if groups == 0 else groups - 1 + -(-(capacity - groups + 1) // tile_m)


def warm_plan(max_rank: int, kinds: dict[str, tuple[int, int]], free_slots: list[int], sms: int = 0):
    """(kind, rank, requests) per warm-up forward. ``kinds``: step kind -> (token capacity, tile_m);
    ``sms``: the device's SM count, where a prefill's (64-row tiles) split of K changes."""
    plan = []
    for kind, (capacity, tile_m) in kinds.items():
        reachable = max_tiles(capacity, tile_m, len(free_slots))
        bounds = prefill_split_bounds(sms) if tile_m >= 64 and sms else ()
        for rank in rank_classes(max_rank):
            for tiles in tile_counts(reachable, bounds):
                reqs = requests_for_tiles(tiles, tile_m, free_slots, capacity)
                if reqs:
                    plan.append((kind, rank, reqs))
    return plan


def module_sets(pools, configured) -> list[frozenset | None]:
    """The module sets to warm: every module (None), then each configured family's set that the pools
    have. A step whose adapters cover only some modules launches the packed projections (q, k, v) with fewer
    slices, another compilation (PEFT's default, q and v, is the common one)."""
    sets: list[frozenset | None] = [None]
    for modules in configured:
        have = frozenset(modules) & frozenset(pools)
        if have and have != frozenset(pools) and have not in sets:
            sets.append(have)
    return sets


def _spans(n: int, max_len: int) -> tuple[torch.Tensor, list[PrefillSpan]]:
    """Positions [n] and prefill spans for ``n`` tokens as sequences of at most ``max_len`` (positions past
    a model's length have no rotary row)."""
    spans, row = [], 0
    while row < n:
        m = min(max_len, n - row)
        spans.append(PrefillSpan(row, m, m, -1))
        row += m
    return torch.arange(n) % max_len, spans


def compile_threads() -> int:
    """Threads that compile the warm-up's kernels: the CPUs this process may use, at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def compile_ahead(forwards, threads: int | None = None) -> int:
    """Run ``forwards`` (CUDA work whose LoRA launches are the ones to compile) with those launches only
    listing their shapes, then compile the shapes side by side on ``threads`` threads (default
    ``compile_threads()``), so that the forwards run for real afterwards find every kernel compiled. Returns
    how many shapes were listed; 0 with one thread (nothing runs ahead). What ``forwards`` raises is raised;
    a compilation that fails is not: it is logged where the compiling itself breaks, and a shape that did
    not compile compiles again at its first launch, which raises its error."""
    threads = compile_threads() if threads is None else threads
    if threads <= 1:
        return 0
    with compile_only() as queued:
        forwards()
    try:
        return compile_queued(queued, threads)
    except Exception as exc:  # noqa: BLE001 - see above
        log.warning("compiling %d LoRA kernels on %d threads failed (%s: %s); they compile on first use",
                    len(queued), threads, type(exc).__name__, exc)  # fmt: skip
        return 0


@torch.inference_mode()
def warm_lora_kernels(runner, kinds: tuple[str, ...]) -> int:
    """Run the warm-up forwards of ``kinds`` (the runner's adapter tiers' metadata builders); returns how many
    forwards ran. Steps hold at most ``max_num_seqs`` groups and the profiled step size (profile_forward's) in tokens;
    only slots free in every pool are used, so nothing an adapter holds is touched. On CUDA their kernels
    compile side by side first (``compile_ahead``)."""
    cfg, tiers, state, device = runner.config, runner.lora, runner.lora_state, runner.device
    tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * runner.max_model_len)
    free = [s for s in range(tiers.gpu.num_slots) if tiers.gpu.ranks[s] == 0][: cfg.max_num_seqs]
    builders = {k: m for k, m in tiers.step_metadata().items() if k in kinds}
    plan = warm_plan(cfg.max_lora_rank, {k: (min(m.capacity, tokens), m.tile_m) for k, m in builders.items()},
                     free, num_sms(device))  # fmt: skip
    sets = module_sets(state.pools, cfg.lora_graph_module_sets)

    def forwards() -> None:
        for kind, rank, reqs in plan:
            _warm_one(runner, builders[kind], rank, reqs, sets)

    try:
        if device.type == "cuda":  # every launch shape first, compiled side by side
            compile_ahead(forwards)
        forwards()
    finally:
        state.metas = dict.fromkeys(state.pools)
        state.force_store = False
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * len(plan) * len(sets)


def _warm_one(runner, builder, rank: int, reqs: list[tuple[int, int]], sets) -> None:
    """The warm-up forwards of one plan entry: each module set, GEMM first and then delta first (the
    storing launches of a step whose every row has an adapter, ``LoRALinear._delta_first``; the free slots
    here cover no row, so it is forced)."""
    tiers, state, device = runner.lora, runner.lora_state, runner.device
    ranks = list(tiers.gpu.ranks)
    for slot, _ in reqs:
        ranks[slot] = rank  # the builder's view only: the device rank table keeps 0 (no work)
    meta = builder.build(reqs, ranks)
    n = sum(t for _, t in reqs)
    ids = torch.arange(1, n + 1, device=device) % runner.vocab_size  # [n]
    positions, spans = _spans(n, runner.max_model_len)
    attn = AttentionMetadata(slot_mapping=torch.full((n,), -1, device=device), prefill=spans)
    for modules in sets:
        state.metas = {m: meta if modules is None or m in modules else None for m in state.pools}
        for force in (False, True):
            state.force_store = force
            runner.model(ids, positions.to(device), attn, torch.tensor([n - 1], device=device))
