"""Megatron's layout on the model of ``model.py``, by module swaps; the model files stay TP-agnostic.

Per rank r of N (heads and MLP columns split evenly, see ``shard_config``):
- ``qkv_proj`` column-parallel by KV-head groups: rank r holds q heads [r Hq/N, (r+1) Hq/N) and exactly the
  KV heads they read, so attention runs locally on the rank's heads and its KV cache holds only them;
- ``gate_up_proj`` column-parallel: gate and up columns [r F/N, (r+1) F/N), so SiLU-mul stays local;
- ``o_proj`` and ``down_proj`` row-parallel: the local GEMM gives a partial sum; the parent module's output
  (``self_attn``, ``mlp``) is all-reduced once, then the row-parallel bias is added. The reduction hangs on the
  parent, not on the projection, so that a LoRA wrapper around the projection adds its partial product
  *before* the sum: the adapter rides on the base's all-reduce and costs no collective of its own;
- the vocabulary split in contiguous row blocks of ceil(V/N) for the embedding (masked lookup + all-reduce)
  and the LM head (local logits, all-gathered; pad rows cut off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplane.engine.model.model import CausalLM
from loraplane.engine.model.model_config import ModelConfig
from loraplane.engine.parallel.group import TPGroup, shard_config


@dataclass(frozen=True, slots=True)
class VocabShard:
    start: int  # first token id of this rank
    rows: int  # real rows (the last rank may hold fewer)
    padded: int  # rows every rank allocates: ceil(V / N)

    @classmethod
    def of(cls, vocab_size: int, tp: TPGroup) -> VocabShard:
        padded = -(-vocab_size // tp.size)
        start = min(tp.rank * padded, vocab_size)
        return cls(start, min(padded, vocab_size - start), padded)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; other ids look up zeros, then the sum over ranks."""

    def __init__(self, shard: VocabShard, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.shard, self.tp = shard, tp
        self.weight = nn.Parameter(torch.zeros(shard.padded, dim))  # pad rows stay zero

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start  # [T]
        outside = (local < 0) | (local >= self.shard.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        x = x.masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce_(x)


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered over ranks into [S, V]."""

    def __init__(self, shard: VocabShard, dim: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.shard, self.tp, self.vocab_size = shard, tp, vocab_size
        self.weight = nn.Parameter(torch.zeros(shard.padded, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight)  # [S, V/N padded]
        return self.tp.all_gather_last(local)[:, : self.vocab_size]  # [S, V]


class RowParallelLinear(nn.Linear):
    """Input columns of this rank; the GEMM gives a partial sum. The bias is added once, after the parent's
    all-reduce (``_reduce_output``), so forward leaves it out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


ROW_PARALLEL = {"self_attn": "o_proj", "mlp": "down_proj"}  # parent module -> its row-parallel projection


def _reduce_output(tp: TPGroup, proj: str):
    def hook(parent: nn.Module, _args, out: torch.Tensor) -> torch.Tensor:
        tp.all_reduce_(out)  # [T, H] partial sums of every rank (base + any LoRA contribution)
        bias = getattr(parent, proj).bias  # a LoRA wrapper forwards base_layer.bias
        return out if bias is None else out + bias

    return hook


def build_sharded_model(cfg: ModelConfig, tp: TPGroup) -> CausalLM:
    """CausalLM with rank ``tp.rank``'s shapes on the meta device (the caller materialises and fills it).

    ``model.config`` is the rank's config (its heads, its MLP width, the whole vocabulary)."""
    local = shard_config(cfg, tp.size)
    model = CausalLM(local)
    shard = VocabShard.of(cfg.vocab_size, tp)
    model.model.embed_tokens = VocabParallelEmbedding(shard, cfg.hidden_size, tp)
    model.lm_head = VocabParallelLMHead(shard, cfg.hidden_size, cfg.vocab_size, tp)
    for layer in model.model.layers:
        for parent_name, proj in ROW_PARALLEL.items():
            parent = getattr(layer, parent_name)
            old = getattr(parent, proj)
            setattr(
                parent, proj, RowParallelLinear(old.in_features, old.out_features, bias=old.bias is not None)
            )
            parent.register_forward_hook(_reduce_output(tp, proj))
    return model


def shard_rows(cfg: ModelConfig, tp: TPGroup) -> dict[str, tuple[int, int]]:
    """Per HF projection kind: (first source row or column, count) that rank ``tp.rank`` reads."""
    r, n, d = tp.rank, tp.size, cfg.head_dim
    q, kv, f = cfg.num_heads // n * d, cfg.num_kv_heads // n * d, cfg.intermediate_size // n
    shard = VocabShard.of(cfg.vocab_size, tp)
    return {
        "q_proj": (r * q, q),
        "k_proj": (r * kv, kv),
        "v_proj": (r * kv, kv),
        "gate_proj": (r * f, f),
        "up_proj": (r * f, f),
        "o_proj": (r * q, q),  # input columns
        "down_proj": (r * f, f),  # input columns
        "vocab": (shard.start, shard.rows),
    }
