"""One decoder for Llama, Qwen2 and Mistral (gpt-fast style). It knows nothing of LoRA or scheduling.

Module names mirror Hugging Face's (``model.layers.{i}.self_attn.o_proj`` ...), except that q/k/v and gate/up
are packed into ``qkv_proj`` and ``gate_up_proj`` (one GEMM each; PACKED_MODULES names their members). Every
projection is a plain nn.Linear, so a later wrapper can replace it with a ``base_layer`` wrapper. Tokens of all
sequences of a step are flattened into one [T, ...] batch; per-step paging facts arrive in
``AttentionMetadata`` and each layer's KV cache is attached by the runner (``attn.k_cache``/``v_cache``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loraplane.engine.model.attention import AttentionMetadata, paged_attention
from loraplane.engine.model.fused_ops import rmsnorm, rope_and_store_kv, silu_mul
from loraplane.engine.model.model_config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rmsnorm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies, with Llama-3 / linear scaling as transformers computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# Packed projections: one GEMM each instead of three / two. HF checkpoints keep them apart; PACKED_MODULES
# tells the loader (and a later LoRA wrapper) which rows of the packed output each HF projection owns.
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def packed_output_sizes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Row count of each member projection inside its packed module, in packing order."""
    return {
        "qkv_proj": (cfg.q_size, cfg.kv_size, cfg.kv_size),
        "gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size),
    }


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # output rows: [q (num_heads * D) | k (num_kv_heads * D) | v (num_kv_heads * D)]
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, kv_heads, head_dim], set by the runner
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        T, Hq, Hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, Hq + 2 * Hkv, self.head_dim)  # [T, Hq + 2 Hkv, D]
        rope_and_store_kv(qkv, Hq, Hkv, positions, *rope, self.k_cache, self.v_cache, meta.slot_mapping)
        q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)  # views [T, H*, D]
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.view(T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # output rows: [gate (F) | up (F)]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, rope, meta):
        """x: [T, H] this layer's input delta; residual: [T, H] running sum (None at layer 0)."""
        if residual is None:
            residual = x.clone()
            h, _ = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, rope, meta) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.embed_tokens(input_ids), None  # [T, H]
        for layer in self.layers:
            x, residual = layer(x, residual, positions, rope, meta)
        return x, residual


class CausalLM(nn.Module):
    """Top module; state-dict names equal Hugging Face's ``*ForCausalLM`` names but for the packed modules."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_cos = torch.empty(0)  # [max_pos, D/2] fp32, built by init_rope on the run device
        self.rope_sin = torch.empty(0)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        cfg = self.config
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [max_pos, D/2]
        self.rope_cos, self.rope_sin = freqs.cos().contiguous(), freqs.sin().contiguous()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """input_ids, positions: [T]; logits_indices: [S] rows to score (None: all). Returns fp32 logits [S, V]."""
        x, residual = self.model(input_ids, positions, (self.rope_cos, self.rope_sin), meta)
        if logits_indices is not None:
            if logits_indices.numel() == 0:  # a step of partial prefill chunks: KV only, nothing to score
                return x.new_empty((0, self.config.vocab_size), dtype=torch.float32)
            x, residual = x[logits_indices], residual[logits_indices]
        h, _ = self.model.norm(x, residual)
        return self.lm_head(h).float()
