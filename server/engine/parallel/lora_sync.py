"""Adapters over tensor parallelism: S-LoRA's layout, with rank 0 deciding every move.

Layout per rank (``shard_adapter``):
- column-parallel modules (q, k, v, gate, up): A replicated [r, H]; B sharded like the base rows [out/N, r];
- row-parallel modules (o, down): A sharded on its input dim [r, in/N]; B replicated [H, r]. The partial
  ``B (A_r x_r)`` of each rank is added to the base's partial output before the layer's one all-reduce (see
  layers.py), which sums the T x r shrink results' contributions exactly as a separate all-reduce of the
  shrink would, with no collective of its own.

Residency: only rank 0 runs the registry, the tiers and eviction. Its GPU tier reports every copy and
eviction to ``AdapterMirror``, which broadcasts the slots and the factors; each worker allocates the same
slots in its own pools (allocation is deterministic, and checked) and writes its shard. Each step, rank 0
sends the slot of every chunk's adapter per module, from which the workers build the same batch metadata.
"""

from __future__ import annotations

import torch

from ..lora_weights import TARGET_MODULES, AdapterWeights, module_shapes
from ..model_config import ModelConfig
from . import step_sync
from .group import TPGroup
from .layers import shard_rows

_ROW_PARALLEL = ("o_proj", "down_proj")
KINDS = ("decode", "prefill", "graph")  # LoRABatchMeta sets of the adapter manager, by step kind


def shard_adapter(weights: AdapterWeights, cfg: ModelConfig, tp: TPGroup) -> AdapterWeights:
    """This rank's part of a whole adapter (``cfg``: the whole model's config)."""
    shards = shard_rows(cfg, tp)
    out = AdapterWeights(a={}, b={}, ranks=dict(weights.ranks))
    for m in weights.a:
        first, count = shards[m]
        a, b = weights.a[m], weights.b[m]  # [L, r, in], [L, out, r]
        if m in _ROW_PARALLEL:
            out.a[m], out.b[m] = a[:, :, first : first + count], b
        else:
            out.a[m], out.b[m] = a, b[:, first : first + count]
    return out


class AdapterMirror:
    """Rank 0's GPU tier calls ``copy``/``evict``; the same moves happen on every worker."""

    def __init__(self, driver, cfg: ModelConfig) -> None:
        self.driver, self.cfg = driver, cfg

    def copy(self, slots: dict[str, int], weights: AdapterWeights) -> AdapterWeights:
        """Send the slots and whole factors; return rank 0's shard (what its pools hold)."""
        info = [v for m, slot in slots.items() for v in (TARGET_MODULES.index(m), weights.ranks[m], slot)]
        tensors = [t for m in slots for t in (weights.a[m], weights.b[m])]
        self.driver.send_op(step_sync.OP_COPY, info, tensors)
        return shard_adapter(weights, self.cfg, self.driver.tp)

    def evict(self, slots: dict[str, int]) -> None:
        info = [v for m, slot in slots.items() for v in (TARGET_MODULES.index(m), slot)]
        self.driver.send_op(step_sync.OP_EVICT, info, [])


def step_slots(lora, batch, kind: str) -> tuple[int, list[int]]:
    """(kind code, per chunk: tokens then the slot per module or -1) of rank 0's prepared step; (0, []) without
    adapters."""
    if lora is None:
        return 0, []
    out = []
    for chunk in batch.chunks:
        key = getattr(chunk.seq, "adapter", None)
        slots = lora.gpu.slots.get(key, {}) if key is not None else {}
        out += [chunk.num_tokens, *(slots.get(m, -1) for m in TARGET_MODULES)]
    return KINDS.index(kind) + 1, out


# ----------------------------------------------------------------------------------------- worker side
def apply_copy(runner, tp: TPGroup, cfg: ModelConfig, info: list[int]) -> None:
    """Allocate the slots rank 0 chose, receive the whole factors, keep this rank's shard."""
    pools, shapes = runner.lora.gpu.pools, module_shapes(cfg)
    whole = AdapterWeights(a={}, b={})
    slots = {}
    for i in range(0, len(info), 3):
        m, rank, slot = TARGET_MODULES[info[i]], info[i + 1], info[i + 2]
        got = pools[m].allocate(rank, 1.0)
        if got != slot:
            raise RuntimeError(f"rank {tp.rank}: adapter slot {got} for {m}, rank 0 chose {slot}")
        fan_in, fan_out = shapes[m]
        a = torch.empty(cfg.num_layers, rank, fan_in, dtype=runner.dtype, device=tp.device)
        b = torch.empty(cfg.num_layers, fan_out, rank, dtype=runner.dtype, device=tp.device)
        whole.a[m], whole.b[m], whole.ranks[m] = tp.broadcast_(a), tp.broadcast_(b), rank
        slots[m] = slot
    runner.lora.gpu._write(slots, shard_adapter(whole, cfg, tp))


def apply_evict(runner, info: list[int]) -> None:
    pools = runner.lora.gpu.pools
    for i in range(0, len(info), 2):
        pools[TARGET_MODULES[info[i]]].free(info[i + 1])


def set_step_metas(runner, kind_code: int, table: list[int]) -> None:
    """Build the same per-module batch metadata rank 0 built for this step."""
    if runner.lora is None:
        return
    if kind_code == 0:
        runner.lora_state.metas = dict.fromkeys(runner.lora_state.pools)
        return
    kind, width = KINDS[kind_code - 1], 1 + len(TARGET_MODULES)
    rows = [table[i : i + width] for i in range(0, len(table), width)]
    metas = {}
    for j, m in enumerate(TARGET_MODULES):
        reqs = [(row[1 + j], row[0]) for row in rows]
        if kind != "graph" and all(s < 0 for s, _ in reqs):
            metas[m] = None
            continue
        metas[m] = runner.lora._metas[kind][m].build(reqs, runner.lora.gpu.pools[m].host_ranks())
    runner.lora_state.metas = metas
