"""Attention over a paged KV cache.

Layout: per layer ``k_cache``/``v_cache`` of shape [num_blocks, block_size, num_kv_heads, head_dim]; the KV of
position p of a sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

Paths (semantics identical: a query at position p attends causally to positions [0, p] of its sequence):
- prefill spans (any chunk on CPU; multi-token chunks on GPU): gather the span's context from the cache and
  call SDPA with a bottom-right causal mask; a span whose context is only itself skips the gather;
- decode rows (single-token chunks on GPU): a Triton paged flash-decoding kernel that walks block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    q_start: int  # first row of this chunk in the flattened batch
    q_len: int  # rows (new tokens) of this chunk
    ctx_len: int  # positions attended: [0, ctx_len), the chunk's own tokens last
    gather_start: int  # offset of its context in AttentionMetadata.gather_slots; -1: context == the chunk

    def __post_init__(self) -> None:
        if not (0 < self.q_len <= self.ctx_len):
            raise ValueError(f"PrefillSpan: need 0 < q_len <= ctx_len, got {self.q_len}, {self.ctx_len}")


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner; shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64, -1: do not store (padding rows of a CUDA graph)
    prefill: list[PrefillSpan] = field(default_factory=list)
    gather_slots: torch.Tensor | None = None  # [sum ctx_len of spans that gather] int64
    decode_rows: torch.Tensor | None = None  # [Bd] int64 rows for the decode kernel; None: every row
    block_tables: torch.Tensor | None = None  # [Bd, W] int32; None: no decode rows
    seq_lens: torch.Tensor | None = None  # [Bd] int32 context length incl. the new token


# --------------------------------------------------------------------------------------------- KV write
@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v, ROW: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        mask = cols < ROW
        k = tl.load(k_ptr + t * stride_k + cols, mask=mask)
        v = tl.load(v_ptr + t * stride_v + cols, mask=mask)
        tl.store(kc_ptr + slot * ROW + cols, k, mask=mask)
        tl.store(vc_ptr + slot * ROW + cols, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, triton_: bool | None = None) -> None:  # fmt: skip
    """k, v: [T, Hkv, D]; caches [N, B, Hkv, D]; slot_mapping [T] -> cache rows written in place."""
    T, H, D = k.shape
    if not (k.is_cuda if triton_ is None else triton_):
        k_cache.view(-1, H, D).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, H, D).index_copy_(0, slot_mapping, v)
        return
    assert k.stride(1) == D and v.stride(1) == D and k_cache.is_contiguous()
    _write_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=H * D,
                           BLOCK=triton.next_power_of_2(H * D), num_warps=4)  # fmt: skip


# ---------------------------------------------------------------------------------------- prefill (SDPA)
def _sdpa_span(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, Hq, D]; k, v: [L, Hkv, D] with the queries at the last n positions -> [n, Hq, D]."""
    if not q.is_cuda:
        return _sdpa_span_cpu(q, k, v, scale)
    n, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    if n == L:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        rows = torch.arange(L - n, L, device=q.device)[:, None]
        mask = torch.arange(L, device=q.device)[None, :] <= rows  # [n, L] bottom-right causal
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.squeeze(0).transpose(0, 1)  # [n, Hq, D]


def _sdpa_span_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """_sdpa_span on the CPU, bit-identical to it: SDPA's own GQA instead of copying K and V per q head, and
    no mask for a single query (the last position sees the whole context). Every CPU decode step runs this in
    every layer; the two copies and the mask cost more than the attention itself at SmolLM2's sizes."""
    n, L = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, n or L, D]
    if n == L or n == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n > 1, scale=scale, enable_gqa=gqa)
    else:
        rows = torch.arange(L - n, L, device=q.device)[:, None]
        mask = torch.arange(L, device=q.device)[None, :] <= rows  # [n, L] bottom-right causal
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)  # [n, Hq, D]


def _prefill(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    H, D = k.shape[1], k.shape[2]
    k_ctx = v_ctx = None
    if meta.gather_slots is not None and meta.gather_slots.numel():
        # index_select copies whole rows; advanced indexing ([slots]) costs 10-30x more on the CPU at 2 threads
        k_ctx = k_cache.view(-1, H, D).index_select(0, meta.gather_slots)  # [sum ctx, Hkv, D]
        v_ctx = v_cache.view(-1, H, D).index_select(0, meta.gather_slots)
    for s in meta.prefill:
        rows = slice(s.q_start, s.q_start + s.q_len)
        if s.gather_start < 0:
            ks, vs = k[rows], v[rows]
        else:
            ctx = slice(s.gather_start, s.gather_start + s.ctx_len)
            ks, vs = k_ctx[ctx], v_ctx[ctx]
        out[rows] = _sdpa_span(q[rows], ks, vs, scale)


# ------------------------------------------------------------------------------------ decode (Triton)
@triton.jit
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr, scale,
                         stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         IEEE: tl.constexpr):  # fmt: skip
    """Program (b, kv head, split): the GROUP q heads sharing a kv head are the rows of one tl.dot; the split
    walks its share of the context, BLOCK_N positions (several pages) per iteration, with an online softmax."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    heads = kvh * GROUP + g
    gmask = g < GROUP
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        blk = tl.load(bt_ptr + b * stride_bt + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        off = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + kvh * stride_ch  # [BLOCK_N]
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=kvmask, other=0.0)  # [BLOCK_N, D_PAD]
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kvmask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if NUM_SPLITS == 1:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # empty (padding) rows write zeros, not NaN
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask)  # fmt: skip
    else:  # partials [B, Hq, S, D_PAD] and (m, l) [B, Hq, S, 2], merged by _merge_splits_kernel
        row = (b * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=gmask)


@triton.jit
def _merge_splits_kernel(part_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, H, D: tl.constexpr,
                         D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_PAD)
    row = (b * H + h) * NUM_SPLITS + s  # [S]
    m = tl.load(ml_ptr + row * 2)
    l_split = tl.load(ml_ptr + row * 2 + 1)  # each split's softmax denominator
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: a padding row
    w = tl.exp(m - m_max)  # empty splits: exp(-inf) = 0
    denom = tl.sum(w * l_split, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.load(part_ptr + row[:, None] * D_PAD + d[None, :])  # [S, D_PAD]
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


# Split the context only while (batch x kv heads) leaves SMs idle: measured on the H200 (B=64, ctx 512, one
# layer) 1 split took 74 us, 2/4/8 splits 89/92/91 us; at B=1 16 splits cut the step 5.08 -> 4.89 ms.
_TARGET_PROGRAMS = 128


def default_num_splits(batch: int, num_kv_heads: int) -> int:
    """Static per batch size (CUDA graphs need fixed shapes): splits only when (batch x kv heads) is small."""
    want = _TARGET_PROGRAMS // max(1, batch * num_kv_heads)
    return 1 if want <= 1 else min(16, 1 << (want.bit_length() - 1))  # a power of two (merge kernel's arange)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, block_n: int = 64,
                 num_warps: int = 4, num_stages: int = 2, num_splits: int | None = None) -> torch.Tensor:  # fmt: skip
    """q: [B, Hq, D]; caches [N, bs, Hkv, D]; block_tables [B, W] int32; seq_lens [B] int32 -> [B, Hq, D]."""
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    group, d_pad = Hq // Hkv, max(16, triton.next_power_of_2(D))
    splits = default_num_splits(B, Hkv) if num_splits is None else num_splits
    assert splits & (splits - 1) == 0, f"num_splits must be a power of two, got {splits}"
    out = torch.empty_like(q) if out is None else out
    part = ml = out  # unused unless split
    if splits > 1:
        part = torch.empty(B, Hq, splits, d_pad, dtype=torch.float32, device=q.device)
        ml = torch.empty(B, Hq, splits, 2, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, ml, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=D, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_N=max(block_n, block_size), NUM_SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(B, Hq)](part, ml, out, out.stride(0), out.stride(1), Hq, D=D, D_PAD=d_pad,
                                      NUM_SPLITS=splits, num_warps=4)  # fmt: skip
    return out


def paged_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Plain-torch reference of paged_decode (for tests)."""
    bs, H, D = k_cache.shape[1:]
    outs = []
    for i in range(q.shape[0]):
        L = int(seq_lens[i])
        pos = torch.arange(L, device=q.device)
        slots = block_tables[i].long()[pos // bs] * bs + pos % bs
        outs.append(
            _sdpa_span(q[i : i + 1], k_cache.view(-1, H, D)[slots], v_cache.view(-1, H, D)[slots], scale)
        )
    return torch.cat(outs)


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (already in the cache) -> [T, Hq, D]."""
    if meta.block_tables is not None and meta.decode_rows is None:
        return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    out = torch.empty_like(q)
    if meta.prefill:
        _prefill(q, k, v, k_cache, v_cache, meta, scale, out)
    if meta.block_tables is not None:
        out[meta.decode_rows] = paged_decode(q[meta.decode_rows], k_cache, v_cache, meta.block_tables,
                                             meta.seq_lens, scale)  # fmt: skip
    return out
