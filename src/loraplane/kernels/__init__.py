"""Multi-LoRA kernels (Triton) and their plain-torch references. Imports nothing else of loraplane.

Engine API: ``LoRAPool`` (paged adapter weights in a byte budget), ``LoRABatchMeta`` (per-step batch
metadata in fixed device buffers) and ``lora_apply`` (y += scale * x @ A^T @ B^T per token's adapter).
"""

from loraplane.kernels.metadata import LoRABatchMeta
from loraplane.kernels.module_spec import RANK_LIMIT, ModuleSpec, rank_error
from loraplane.kernels.ops import covers_every_row, lora_apply, lora_apply_many, lora_expand, lora_shrink
from loraplane.kernels.pool import LoRAPool, PoolFullError, lora_scale

__all__ = [
    "RANK_LIMIT",
    "LoRABatchMeta",
    "LoRAPool",
    "ModuleSpec",
    "PoolFullError",
    "covers_every_row",
    "lora_apply",
    "lora_apply_many",
    "lora_expand",
    "lora_scale",
    "lora_shrink",
    "rank_error",
]
