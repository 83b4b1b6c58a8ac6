"""Per-row logits processing, as vLLM defines it: logit bias, min_tokens, penalties, min-p, and the grammar
mask of structured output.

Each function is one batched tensor operation over the step's logits [S, V]; the rows that use a control and
their settings arrive as small per-row tensors built once per step (sampling_batch.py), so no request costs
a launch of its own. Order (the sampler's): logit bias and the min_tokens mask on the raw logits, then the
penalties; greedy rows take the argmax of that; random rows then apply temperature, min-p, top-k / top-p.
"""

from __future__ import annotations

import torch


def add_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, bias: torch.Tensor) -> None:
    """logits[rows[i], cols[i]] += bias[i] (in place); rows, cols: [N] int64, bias: [N] fp32."""
    logits.index_put_((rows, cols), bias, accumulate=True)


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """logits[rows[i], cols[i]] = -inf (in place): min_tokens keeps the stop tokens out of reach."""
    logits.index_put_((rows, cols), torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's (and OpenAI's) penalties on logits [P, V] -> [P, V].

    prompt_mask: [P, V] bool, the token is in the prompt; output_counts: [P, V] its occurrences in the output;
    presence, frequency, repetition: [P]. A token seen in prompt or output has a positive logit divided by
    the repetition penalty and a negative one multiplied by it; then frequency * count and presence * (count > 0)
    are subtracted (output tokens only).
    """
    counts = output_counts.to(logits.dtype)
    seen = prompt_mask | (output_counts > 0)
    penalty = torch.where(seen, repetition.unsqueeze(1), 1.0)  # [P, V]
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - frequency.unsqueeze(1) * counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the likeliest token's; logits [S, V], min_p [S]
    (0: off). Applied after temperature, as vLLM does."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


_BITS = 32  # tokens per word of a grammar bitmask


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[rows[i], t] = -inf (in place) for every token t whose bit is clear in bitmask[i];
    logits [S, V], rows [C] int64, bitmask [C, ceil(V / 32)] int32 (bit j of word w: token 32w + j)."""
    V = logits.shape[1]
    shifts = torch.arange(_BITS, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(2) >> shifts) & 1).flatten(1)[:, :V]  # [C, W * 32] -> [C, V]
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))
