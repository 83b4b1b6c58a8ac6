"""The dominant adapter merged into a copy of the base weights (dLoRA's merged mode).

When every token of a step belongs to one adapter K, its delta can ride inside the base GEMM:
``W'_K = W + scale_K · B_K @ A_K`` for each packed projection K targets. Such a step then runs the base
model's kernels on W' and launches no LoRA kernel at all: a step of one adapter costs a base step.

The merged weights live in their own buffers, one per wrapped projection (``LoRALinear.merged_weight``),
allocated at start-up and counted against the KV budget; the base weights are never written, so
"unmerging" is exact by construction and free (the next step simply reads W again). Steps that mix K
with other adapters or with base-only tokens run unmerged on W, exactly as without merging: a mixed
step costs what it costs today, never two LoRA terms.

When to merge (``MergePolicy``, hysteresis as in dLoRA): K is merged after ``after_steps`` consecutive
steps in which it holds at least ``merge_share`` of the tokens (1.0: every token), which costs one pass
over the affected weights; K stays merged while its share is at least ``stay_share`` (0.56), and a
step of K alone is then served from W'. Below that share K is unmerged; its W' is kept, so merging K
again after another run costs nothing, while merging another adapter overwrites it.

Memory: one copy of every wrapped projection's weight (on a Llama-3-8B shape 32 × 218 M parameters,
13.96 GB in bf16). Tensor parallel serves adapters unmerged.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from loraplane.engine.api import AdapterError
from loraplane.engine.lora.layers import PROJECTIONS, LoRALinear, LoRAStepState


@dataclass(frozen=True, slots=True)
class MergePolicy:
    """Hysteresis between merging (share >= merge_share for after_steps steps) and staying merged
    (share >= stay_share). Shares are fractions of a step's tokens."""

    after_steps: int = 8
    stay_share: float = 0.56
    merge_share: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.after_steps, int) or self.after_steps < 1:
            raise ValueError(f"MergePolicy.after_steps must be an int >= 1, got {self.after_steps!r}")
        if not 0.0 < self.stay_share <= self.merge_share <= 1.0:
            raise ValueError(
                f"MergePolicy: need 0 < stay_share ({self.stay_share}) <= merge_share ({self.merge_share}) <= 1"
            )


def projection_weights(model: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """Every packed projection's base weight [out, in], by (layer, projection name)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for parent_name, proj in PROJECTIONS:
            lin = getattr(getattr(layer, parent_name), proj)
            out[(i, proj)] = lin.base_layer.weight if isinstance(lin, LoRALinear) else lin.weight
    return out


class AdapterMerger:
    """Decides, per step, whether the step runs on merged weights, and keeps those weights up to date.

    ``begin_step(chunks)`` returns True when the step runs merged: every token carries the merged
    adapter. The caller then runs the model with ``state.merged`` set and no LoRA metadata (eagerly, or
    by replaying graphs captured that way)."""

    def __init__(self, model: nn.Module, policy: MergePolicy) -> None:
        self.model, self.policy = model, policy
        # W' buffers [out, in] per projection, allocated now so that KV sizing accounts for them.
        self.weights = {k: torch.empty_like(w) for k, w in projection_weights(model).items()}
        self.bytes = sum(w.numel() * w.element_size() for w in self.weights.values())
        self.manager = None
        self.state: LoRAStepState | None = None
        self.active: str | None = None  # the adapter the current steps count as merged
        self.held: tuple[str, str] | None = None  # (key, digest) whose delta W' holds
        self._streak: tuple[str | None, int] = (None, 0)
        self.stats = {"merges": 0, "merged_steps": 0, "unmerges": 0, "merge_s": 0.0}

    def bind(self, manager, state: LoRAStepState) -> None:
        """Attach the W' buffers to the wrapped projections and read adapters through ``manager``."""
        self.manager, self.state = manager, state
        for i, layer in enumerate(self.model.model.layers):
            for parent_name, proj in PROJECTIONS:
                lin = getattr(getattr(layer, parent_name), proj)
                if not isinstance(lin, LoRALinear):
                    raise TypeError(f"layer {i} {proj}: not wrapped for LoRA; wrap the model before bind()")
                lin.merged_weight = self.weights[(i, proj)]

    # -- the policy ----------------------------------------------------------------------------------
    def begin_step(self, chunks: list[tuple[str | None, int]]) -> bool:
        """Observe one step's (adapter key or None, tokens); merge or unmerge per the policy. Returns
        True when the step runs on W' (every token has the merged adapter)."""
        tokens = Counter()
        for key, n in chunks:
            tokens[key] += n
        total = sum(tokens.values())
        if total == 0:
            return False
        top, top_n = max(((k, n) for k, n in tokens.items() if k is not None), key=lambda kn: kn[1],
                         default=(None, 0))  # fmt: skip
        if self.active is not None and tokens.get(self.active, 0) < self.policy.stay_share * total:
            self.active = None  # stopped dominating: W is read again from the next step on
            self.stats["unmerges"] += 1
        prev, run = self._streak
        run = run + 1 if top == prev else 1
        self._streak = (
            (top, run) if top is not None and top_n >= self.policy.merge_share * total else (None, 0)
        )
        if self.active is None and self._streak[0] is not None and self._streak[1] >= self.policy.after_steps:
            try:
                self.merge(self._streak[0])
            except AdapterError:  # not resident and cannot be made so: the step runs unmerged and says why
                self._streak = (None, 0)
        merged = self.active is not None and tokens.get(self.active, 0) == total
        self.stats["merged_steps"] += merged
        return merged

    # -- the weights ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def merge(self, key: str) -> None:
        """Make ``key`` the merged adapter: W' = W + its delta, unless W' already holds it."""
        ident = (key, self.manager.digest(key))
        if self.held != ident:
            start = time.perf_counter()
            self.held = None  # a failure half-way leaves W' holding nothing
            self.manager.ensure_resident([key])
            self._write(self.manager.gpu.slots[key])
            self.held = ident
            self.stats["merge_s"] += time.perf_counter() - start
            self.stats["merges"] += 1
        self.active = key

    def unmerge(self) -> None:
        """Serve every later step from W (W' stays as it is: merging the same adapter again is free)."""
        self.active = None

    def _write(self, slots: dict[str, int]) -> None:
        """W'[cols of m] = W + scale · B_m @ A_m for each PEFT module m the adapter has, other columns = W.
        One GEMM per module writes W' straight from W (``addmm``: W read once, the sum accumulated in fp32
        and rounded once), so a merge moves about one read of W and one write of W' per targeted module."""
        pools = self.state.pools
        rows = {m: pools[m].rows_of(s) for m, s in slots.items()}  # [r_m] physical rank-rows, every layer
        for i, layer in enumerate(self.model.model.layers):
            for parent_name, proj in PROJECTIONS:
                lin = getattr(getattr(layer, parent_name), proj)
                w, w_merged = lin.base_layer.weight, self.weights[(i, proj)]  # [out, in]
                for m, c0, c1 in lin.slices:
                    if m not in slots:
                        w_merged[c0:c1].copy_(w[c0:c1])
                        continue
                    a = pools[m].a[(i, m)][0, rows[m]]  # [r, in]
                    bt = pools[m].bt[(i, m)][rows[m]]  # [r, out]
                    torch.addmm(w[c0:c1], bt.t(), a, alpha=pools[m].scale_of(slots[m]), out=w_merged[c0:c1])
