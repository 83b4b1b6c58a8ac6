"""Tensor parallelism: Megatron's layout for the base model, one process per device (see docs/engine.md)."""
