"""Random adapter weights the benchmarks load (values do not matter for speed; scales keep outputs finite)."""

from __future__ import annotations

import torch

from loraplane.engine.lora.weights import AdapterWeights, module_shapes
from loraplane.engine.model.model_config import ModelConfig


def adapter_weights(cfg: ModelConfig, rank: int, modules, dtype: torch.dtype, seed: int,
                    pin: bool = False) -> AdapterWeights:  # fmt: skip
    """One adapter of ``rank`` on ``modules``; A ~ N(0, 1/in), B ~ N(0, 1e-4); pinned when ``pin``."""
    gen = torch.Generator().manual_seed(seed)
    w = AdapterWeights(a={}, b={})
    for m in modules:
        fan_in, fan_out = module_shapes(cfg)[m]
        w.a[m] = (torch.randn(cfg.num_layers, rank, fan_in, generator=gen) * fan_in**-0.5).to(
            dtype
        )  # [L, r, in]
        w.b[m] = (torch.randn(cfg.num_layers, fan_out, rank, generator=gen) * 0.01).to(dtype)  # [L, out, r]
        w.ranks[m] = rank
    return w.pin() if pin else w
