"""The decode step with programmatic dependent launch against the same step without it, in one run.

The decoder's own Triton kernels (``set_model_pdl``) in both engines and the LoRA kernels
(``CapturePolicy.pdl``) in the LoRA engine: the base step and the 64-distinct step are measured on graphs
captured without, then recaptured with, each pair back to back on the same weights and KV.
"""

from __future__ import annotations

import dataclasses

from loraplane.engine.model.cuda_graphs import DecodeGraphs
from loraplane.engine.model.fused_ops import set_model_pdl
from loraplane.engine.model.runner import ModelRunner
from loraplane.kernels.launch_config import capture_policy, set_capture_policy


def recapture_base(base: ModelRunner, base_kv: list, wrapped: list, size: int) -> None:
    """The base engine's decode graph for ``size`` again, on its own KV tensors, with no LoRA metadata."""
    for state in wrapped:
        state.metas, state.merged = dict.fromkeys(state.pools), False
    layers = base.model.model.layers
    saved = [(layer.self_attn.k_cache, layer.self_attn.v_cache) for layer in layers]
    for layer, (k, v) in zip(layers, base_kv, strict=True):
        layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
    try:
        base.graphs = DecodeGraphs(base.model, (size,), base.max_blocks_per_seq, base.device)
    finally:
        for layer, (k, v) in zip(layers, saved, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v


def pdl_rows(base: ModelRunner, runner: ModelRunner, base_kv: list, wrapped: list, size: int, base_step,
             d64_step) -> list[dict]:  # fmt: skip
    """Rows: the base step and the 64-distinct step, without and with PDL (``base_step()`` measures one, in
    ms, on the graphs captured at the time; ``d64_step()`` returns its ms and the step's logits [B, V], whose
    largest difference across the pair goes in the row: PDL changes when kernels start, never a value)."""
    times = {}
    policy = capture_policy()
    try:
        for pdl in (False, True):
            set_model_pdl(pdl)
            set_capture_policy(**{**dataclasses.asdict(policy), "pdl": pdl})
            recapture_base(base, base_kv, wrapped, size)
            runner.capture_lora_graphs((size,))
            times[pdl] = (base_step(), d64_step())
    finally:  # the switches as they were; the graphs stay as last captured (nothing is measured after)
        set_model_pdl(False)
        set_capture_policy(**dataclasses.asdict(policy))
    (b0, (d0, logits0)), (b1, (d1, logits1)) = times[False], times[True]
    diff = float((logits1 - logits0).abs().max())
    return [
        {"case": "PDL: base step, decoder kernels", "section": "pdl", "step_ms": b1, "base_step_ms": b0,
         "x_base": b1 / b0},
        {"case": "PDL: 64 distinct r16, decoder and LoRA kernels", "section": "pdl", "step_ms": d1,
         "base_step_ms": d0, "x_base": d1 / d0, "logits_max_abs_diff": diff},
    ]  # fmt: skip
