"""``Runner``: everything the engine loop asks of the device side, in one protocol (torch-free).

``ModelRunner`` (engine/model/runner.py) implements it on one device, GPU or CPU. Under tensor parallelism
rank 0's ``ModelRunner`` implements it too: ``start_tp_runner`` (engine/parallel/launch.py) gives it a driver
that sends each step to the workers, so the engine cannot tell the two apart. Tests drive the engine with
torch-free fakes of the same shape.

An optional capability is a member whose value says whether the runner has it (``None``: it has not); the
engine reads it and never probes for attributes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loraplane.engine.core.scheduler import ScheduledBatch
    from loraplane.engine.lora.manager import AdapterTiers
    from loraplane.engine.lora.residency import AdapterResidency
    from loraplane.engine.memory.arbiter import GpuMemory


class SampledToken(Protocol):
    """One sampling chunk's token."""

    token_id: int
    logprob: float | None  # of the sampled token, when requested
    top_logprobs: dict[int, float] | None  # the requested top ones


class Runner(Protocol):
    # Facts fixed once the runner is built.
    eos_token_ids: Collection[int]
    num_kv_blocks: int  # KV blocks the block manager hands out
    block_size: int  # tokens per KV block
    max_model_len: int
    vocab_size: int
    base_hash: str  # sha256 over the base weights, or "in-memory" for a model built in memory
    device: object  # str() names it: "cuda:0", "cpu"
    dtype: object  # str() names it: "bfloat16" (a "torch." prefix is dropped)

    # Optional capabilities: None when the runner has none.
    memory: GpuMemory | None  # the arbiter of the KV blocks (None: a split of num_kv_blocks)
    residency: AdapterResidency | None  # what the scheduler sees of the adapters
    lora: AdapterTiers | None  # the adapters themselves (EngineConfig.enable_lora)

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        """Run one step; one token per chunk with ``sample`` set, in chunk order."""
        ...

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget the per-sequence state (sampling generators) of finished sequences."""
        ...

    def warm_adapter(self, key: str) -> float:
        """Make adapter ``key`` resident and run one real forward through it; returns seconds. Only called
        when ``lora`` is set; AdapterError('WarmFailed') when its logits are not finite."""
        ...
