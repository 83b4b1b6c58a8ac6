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

import struct

import torch

from loraplane.engine.lora.weights import TARGET_MODULES, AdapterWeights, module_shapes
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.parallel import step_sync
from loraplane.engine.parallel.group import TPGroup
from loraplane.engine.parallel.layers import shard_rows

_ROW_PARALLEL = ("o_proj", "down_proj")
KINDS = ("decode", "prefill", "graph")  # LoRABatchMeta sets of the adapter manager, by step kind


def shard_adapter(weights: AdapterWeights, cfg: ModelConfig, tp: TPGroup) -> AdapterWeights:
    """This rank's part of a whole adapter (``cfg``: the whole model's config)."""
    shards = shard_rows(cfg, tp)
    out = AdapterWeights(a={}, b={}, ranks=dict(weights.ranks), scales=dict(weights.scales))
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

    def copy(self, slot: int, weights: AdapterWeights) -> AdapterWeights:
        """Send the slot, ranks, slot scales and whole factors; return rank 0's shard (what its pools hold)."""
        info = [slot] + [
            v
            for m in weights.ranks
            for v in (TARGET_MODULES.index(m), weights.ranks[m], _bits(weights.scales.get(m, 1.0)))
        ]
        tensors = [t for m in weights.ranks for t in (weights.a[m], weights.b[m])]
        self.driver.send_op(step_sync.OP_COPY, info, tensors)
        return shard_adapter(weights, self.cfg, self.driver.tp)

    def evict(self, slot: int) -> None:
        self.driver.send_op(step_sync.OP_EVICT, [slot], [])


def step_slots(lora, batch, kind: str | None) -> tuple[int, list[int]]:
    """(kind code, per chunk: its tokens and its adapter's slot or -1) of rank 0's prepared step;
    (0, []) without adapters (kind None: a base-only decode graph)."""
    if lora is None or kind is None:
        return 0, []
    out = []
    for chunk in batch.chunks:
        key = getattr(chunk.seq, "adapter", None)
        out += [chunk.num_tokens, lora.gpu.slot_id[key] if key is not None else -1]
    return KINDS.index(kind) + 1, out


# ----------------------------------------------------------------------------------------- worker side
def _bits(value: float) -> int:
    """A float32 as the int32 of its bits (the op's info is a list of ints)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def _key(slot: int) -> str:
    return f"slot-{slot}"  # workers know adapters by rank 0's slot only


def apply_copy(runner, tp: TPGroup, cfg: ModelConfig, info: list[int]) -> None:
    """Receive the whole factors, keep this rank's shard in the slot rank 0 chose."""
    gpu, shapes, slot = runner.lora.gpu, module_shapes(cfg), info[0]
    whole = AdapterWeights(a={}, b={})
    for i in range(1, len(info), 3):
        m, rank = TARGET_MODULES[info[i]], info[i + 1]
        whole.scales[m] = _float(info[i + 2])
        fan_in, fan_out = shapes[m]
        a = torch.empty(cfg.num_layers, rank, fan_in, dtype=runner.dtype, device=tp.device)
        b = torch.empty(cfg.num_layers, fan_out, rank, dtype=runner.dtype, device=tp.device)
        whole.a[m], whole.b[m], whole.ranks[m] = tp.broadcast_(a), tp.broadcast_(b), rank
    gpu.start_copy(_key(slot), shard_adapter(whole, cfg, tp))
    gpu.wait(_key(slot))  # the next step must read it
    if gpu.slot_id[_key(slot)] != slot:  # same moves in the same order give the same slot
        raise RuntimeError(f"rank {tp.rank}: adapter slot {gpu.slot_id[_key(slot)]}, rank 0 chose {slot}")


def apply_evict(runner, info: list[int]) -> None:
    runner.lora.gpu.evict(_key(info[0]))


def set_step_metas(runner, kind_code: int, table: list[int]) -> None:
    """Build the batch metadata rank 0's AdapterTiers.prepare_step built for this step."""
    if runner.lora is None:
        return
    pools = runner.lora_state.pools
    slots = table[1::2]
    if kind_code == 0 or (KINDS[kind_code - 1] != "graph" and all(s < 0 for s in slots)):
        runner.lora_state.metas = dict.fromkeys(pools)
        return
    kind, gpu = KINDS[kind_code - 1], runner.lora.gpu
    meta = runner.lora._metas[kind].build(list(zip(slots, table[0::2], strict=True)), gpu.ranks)
    if kind == "graph":
        runner.lora_state.metas = dict.fromkeys(pools, meta)
        return
    used = {m for s in set(slots) if s >= 0 for m in gpu.slots[_key(s)]}
    runner.lora_state.metas = {m: meta if m in used else None for m in pools}
