"""Where the KV cache and the adapter pools live on the device: the one place that builds the GPU memory
arbiter (memory/arbiter.py) and what it hands out, for each ``EngineConfig.memory_mode``.

The runner asks its layout three things, in this order, and never looks at the mode itself:

1. ``pools_before_kv``: adapter pools that must exist before the KV budget is measured (the split's, which
   come out of the budget first), or None;
2. ``kv_blocks``: the KV blocks to allocate, from what the split would give KV;
3. ``allocate``: the arbiter, each layer's K and V caches, and the adapter pools built with them (the
   unified arena's views), or None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplane.engine.lora.layers import build_pools, pool_row_bytes
from loraplane.engine.lora.tiers import GpuTier
from loraplane.engine.memory.arbiter import GpuMemory, SplitMemory
from loraplane.engine.memory.pool import UnifiedGpuTier, build_unified, chunk_blocks_for
from loraplane.engine.model.model_config import ModelConfig
from loraplane.kernels import LoRAPool


@dataclass(slots=True)
class Placement:
    memory: GpuMemory
    kv_caches: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # per layer (K, V), each [blocks, block_size, kv_heads, head_dim]
    pools: dict[str, LoRAPool] | None = None  # adapter pools built with the KV cache
    gpu_tier: GpuTier | None = None  # the GPU tier over them (None: a plain GpuTier over the pools)


class _Layout:
    def __init__(self, config, model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.config, self.model_config = config, model_config
        self.block_size, self.dtype, self.device = block_size, dtype, device

    @property
    def kv_block_bytes(self) -> int:
        cfg = self.model_config
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def adapter_pool_bytes(self) -> int:
        """What the split adapter pools hold: lora_pool_bytes, else max_loras adapters of max rank everywhere."""
        cfg = self.config
        if not cfg.enable_lora:
            return 0
        row_bytes = sum(pool_row_bytes(self.model_config, self.dtype).values())
        rows = cfg.lora_pool_bytes // row_bytes if cfg.lora_pool_bytes else cfg.max_loras * cfg.max_lora_rank
        return rows * row_bytes


class SplitLayout(_Layout):
    """KV blocks and the adapter pools have fixed sizes; the arbiter is the trivial ``SplitMemory``."""

    def pools_before_kv(self) -> dict[str, LoRAPool] | None:
        cfg = self.config
        if not cfg.enable_lora:
            return None
        rows = self.adapter_pool_bytes() // sum(pool_row_bytes(self.model_config, self.dtype).values())
        return build_pools(self.model_config, rows, cfg.max_lora_rank, self.dtype, self.device)

    def kv_blocks(self, split_blocks: int) -> int:
        return split_blocks

    def allocate(self, num_blocks: int) -> Placement:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                   torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(cfg.num_layers)]  # fmt: skip
        return Placement(SplitMemory(num_blocks), caches)


class UnifiedLayout(_Layout):
    """One arena per layer holds the KV blocks and the adapter rows; ``UnifiedMemory`` trades its chunks."""

    def pools_before_kv(self) -> None:
        return None  # the pools are views over the arena, built with it

    def kv_blocks(self, split_blocks: int) -> int:
        """One arena for what the split would give KV and the adapter pools, in whole chunks. Measured on
        CUDA, the budget already holds the pools (never allocated); otherwise they are added."""
        blocks = split_blocks
        if self.config.num_kv_blocks is not None or self.device.type != "cuda":
            blocks += -(-self.adapter_pool_bytes() // self.kv_block_bytes)
        chunk = chunk_blocks_for(self.model_config, self.block_size)
        return max(chunk, blocks // chunk * chunk)

    def allocate(self, num_blocks: int) -> Placement:
        lora = self.config.enable_lora
        arenas, memory, pools = build_unified(self.model_config, num_blocks, self.block_size,
                                              self.config.max_lora_rank, self.dtype, self.device, lora)  # fmt: skip
        caches = [(arena[0], arena[1]) for arena in arenas]  # K and V: contiguous, attention is unchanged
        tier = UnifiedGpuTier(pools, memory, self.device) if pools is not None else None
        return Placement(memory, caches, pools, tier)


def memory_layout(config, model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> SplitLayout | UnifiedLayout:  # fmt: skip
    """The layout of ``config.memory_mode`` ("split" or "unified", checked by EngineConfig)."""
    layout = UnifiedLayout if config.memory_mode == "unified" else SplitLayout
    return layout(config, model_config, block_size, dtype, device)
