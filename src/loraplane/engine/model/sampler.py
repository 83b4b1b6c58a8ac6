"""Batched token sampling: logits processing, greedy, temperature, min-p, top-k, top-p, per-request seeds,
logprobs.

Logits processing (logit bias, min_tokens, presence / frequency / repetition penalties, min-p: logits.py) runs
on the logits the model (or its CUDA graph) returned, on a copy, so graphs never change. Sampling draws with the exponential race (argmax of probs / Exp(1) noise), which equals a categorical draw
and needs no host sync. A seeded request draws its noise row from its own ``torch.Generator``, so its
tokens do not depend on what else is in the batch. Logprobs are of the model's distribution (raw logits,
before temperature and truncation), as OpenAI's API reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplane.engine.model.logits import add_logit_bias, apply_min_p, apply_token_bitmask, ban_tokens
from loraplane.engine.model.penalty_kernel import penalize_


@dataclass(slots=True)
class PenaltyRows:
    """The penalised rows of one step (P of the S rows) and where their token counts live."""

    table: torch.Tensor  # [P, 5] fp32 (row, slot, presence, frequency, repetition): penalty_kernel.py
    rows: torch.Tensor  # [P] int64 rows of the batch
    slots: torch.Tensor  # [P] int64 rows of prompt_mask / counts
    prompt_mask: torch.Tensor  # [R, V] bool, shared state (PenaltyState)
    counts: torch.Tensor  # [R, V] int32, shared state: sample() adds each step's tokens


@dataclass(slots=True)
class GrammarRows:
    """The rows of one step under a grammar (C of the S rows) and the tokens each may take next."""

    rows: torch.Tensor  # [C] int64 rows of the batch
    bitmask: (
        torch.Tensor
    )  # [C, ceil(V / 32)] int32 on the logits' device: bit j of word w = token 32w + j allowed


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row parameters of one step's sampled rows (S rows)."""

    temperatures: torch.Tensor  # [S] fp32; 0 -> greedy
    top_ks: torch.Tensor  # [S] int64; 0 -> disabled
    top_ps: torch.Tensor  # [S] fp32; 1 -> disabled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    generators: list[torch.Generator | None]  # [S] per-request generator (seeded requests only)
    num_logprobs: list[int | None]  # [S] None: no logprobs; n: sampled + top-n
    min_ps: torch.Tensor | None = None  # [S] fp32 (0: off); None: no random row uses min-p
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, biases) [N] each
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids): min_tokens' stop tokens
    penalties: PenaltyRows | None = None
    grammar: GrammarRows | None = None  # structured output: rows whose next token a grammar restricts

    def __post_init__(self) -> None:
        S = self.temperatures.shape[0]
        if not (
            self.top_ks.shape[0]
            == self.top_ps.shape[0]
            == len(self.generators)
            == len(self.num_logprobs)
            == S
        ):
            raise ValueError("SamplingMetadata: every per-row field must have the same number of rows")


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


def apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
) -> torch.Tensor:
    """logits: [S, V]; top_ks: [S] (0 = off); top_ps: [S] (1 = off) -> logits with dropped tokens at -inf."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [S, V] ascending
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_ks is not None:
        k = torch.where(top_ks > 0, top_ks, V).clamp(max=V)
        kth = sorted_logits.gather(1, (V - k).unsqueeze(1))  # [S, 1] the k-th largest value
        drop |= sorted_logits < kth
    if top_ps is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        # drop the low tail whose mass is <= 1 - p; the most likely token always stays
        drop |= cum <= (1.0 - top_ps).unsqueeze(1)
        drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _sample_random(
    logits: torch.Tensor, meta: SamplingMetadata, default_gen: torch.Generator | None
) -> torch.Tensor:
    temps = torch.where(meta.temperatures > 0, meta.temperatures, 1.0)
    x = logits / temps.unsqueeze(1)
    if meta.min_ps is not None:
        x = apply_min_p(x, meta.min_ps)
    if meta.any_top_k or meta.any_top_p:
        x = apply_top_k_top_p(
            x, meta.top_ks if meta.any_top_k else None, meta.top_ps if meta.any_top_p else None
        )
    probs = x.softmax(dim=-1)  # [S, V]
    noise = torch.empty_like(probs).exponential_(generator=default_gen)
    for row, gen in enumerate(meta.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Logit bias, the min_tokens ban, penalties, then the grammar's mask; logits [S, V] -> a new [S, V]
    (or ``logits`` itself when no row asks for any)."""
    if meta.bias is None and meta.banned is None and meta.penalties is None and meta.grammar is None:
        return logits
    x = logits.clone()
    if meta.bias is not None:
        add_logit_bias(x, *meta.bias)
    if meta.banned is not None:
        ban_tokens(x, *meta.banned)
    p = meta.penalties
    if p is not None:
        penalize_(x, p.table, p.prompt_mask, p.counts)
    if meta.grammar is not None:  # last: nothing after it may lift a banned token back
        apply_token_bitmask(x, meta.grammar.rows, meta.grammar.bitmask)
    return x


def _count_tokens(meta: SamplingMetadata, tokens: torch.Tensor) -> None:
    """The penalties' output counts take this step's tokens: one scatter-add for every penalised row.

    Not ``index_put_(accumulate=True)``: on CUDA that sorts the indices and checks their bounds with a dozen
    launches, which cost more than the penalties themselves (~0.3 ms a step at B = 64)."""
    p = meta.penalties
    if p is not None:
        V = p.counts.shape[1]
        flat = p.slots * V + tokens[p.rows].to(p.slots.device)  # [P] offsets into counts.view(-1)
        p.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=p.counts.dtype))


def sample(
    logits: torch.Tensor, meta: SamplingMetadata, default_gen: torch.Generator | None = None
) -> SamplerOutput:
    """logits: [S, V] fp32 -> one token per row, plus logprobs where asked (one host transfer)."""
    processed = process_logits(logits, meta)
    greedy = processed.argmax(dim=-1)  # [S]
    if meta.all_greedy:
        tokens = greedy
    else:
        temps = meta.temperatures.to(logits.device)
        tokens = torch.where(temps == 0, greedy, _sample_random(processed, meta, default_gen))
    _count_tokens(meta, tokens)
    wanted = [n for n in meta.num_logprobs if n is not None]
    if not wanted:
        return SamplerOutput(
            tokens.tolist(), [None] * len(meta.num_logprobs), [None] * len(meta.num_logprobs)
        )
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [S]
    top_vals, top_ids = logprobs.topk(max(max(wanted), 1), dim=-1)  # [S, n]
    token_ids, chosen, top_vals, top_ids = (
        tokens.tolist(),
        chosen.tolist(),
        top_vals.tolist(),
        top_ids.tolist(),
    )
    out_lp: list[float | None] = []
    out_top: list[dict[int, float] | None] = []
    for row, n in enumerate(meta.num_logprobs):
        out_lp.append(None if n is None else chosen[row])
        out_top.append(None if n is None else dict(zip(top_ids[row][:n], top_vals[row][:n], strict=True)))
    return SamplerOutput(token_ids, out_lp, out_top)
