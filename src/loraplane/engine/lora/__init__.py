"""Adapters inside the engine: the tier manager (GPU, pinned host, disk), weight loading, LoRA layers, residency."""
