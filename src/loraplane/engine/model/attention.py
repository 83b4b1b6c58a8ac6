"""Attention over a paged KV cache.

Layout: per layer ``k_cache``/``v_cache`` of shape [num_blocks, block_size, num_kv_heads, head_dim]; the KV of
position p of a sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

Paths (semantics identical: a query at position p attends causally to positions [0, p] of its sequence):
- prefill spans on GPU in bf16/fp16: one variable-length flash-attention call for every span of the step
  (grouped-query heads served natively, causal mask aligned bottom-right per span); a span whose context is only
  itself reads its K/V rows as they are, a continued span reads its context gathered from the cache;
- prefill spans otherwise (CPU, fp32): one SDPA call per span with a bottom-right causal mask;
- decode rows (single-token chunks on GPU): a Triton paged flash-decoding kernel that walks block tables,
  optionally splitting each context over several programs (flash-decoding) and merging the partial results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loraplane.engine.model.fused_ops import model_pdl_args
from loraplane.kernels.pdl import launch_dependents, wait_for_kernel_ahead


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
    varlen: tuple | None = None  # derived by the first layer (_varlen_inputs), shared by the others


# --------------------------------------------------------------------------------------------- KV write
@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v, ROW: tl.constexpr,
                     BLOCK: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    wait_for_kernel_ahead(GDC)
    launch_dependents(GDC)
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
                           BLOCK=triton.next_power_of_2(H * D), num_warps=4, **model_pdl_args(k))  # fmt: skip


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


# ------------------------------------------------------------------------ prefill (varlen flash attention)
def _flash_ok(q: torch.Tensor) -> bool:
    """Flash attention's reach: CUDA, half precision, head_dim a multiple of 8 up to 256."""
    D = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 256


def _varlen_inputs(meta: AttentionMetadata, device: torch.device) -> tuple | None:
    """(first row, last row, cu_seqlens_q, cu_seqlens_k, max_q, max_k) of the prefill spans, or None when
    they do not cover one contiguous run of rows in order (then each span runs on its own). Built on the host
    from the spans alone, once per step (every layer reuses it)."""
    if meta.varlen is None:
        spans, cu_q, cu_k, ok = meta.prefill, [0], [0], True
        for a, b in zip(spans, spans[1:], strict=False):
            ok &= a.q_start + a.q_len == b.q_start
        for s in spans:
            cu_q.append(cu_q[-1] + s.q_len)
            cu_k.append(cu_k[-1] + s.ctx_len)
        cu = torch.tensor(cu_q + cu_k, dtype=torch.int32).to(device, non_blocking=True)
        n = len(cu_q)
        meta.varlen = (spans[0].q_start, spans[0].q_start + cu_q[-1], cu[:n], cu[n:],
                       max(s.q_len for s in spans), max(s.ctx_len for s in spans)) if ok else ()  # fmt: skip
    return meta.varlen or None


def _prefill_flash(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, varlen: tuple):
    """Every prefill span in one flash-attention call -> [rows of the spans, Hq, D]. Flash's causal mask is
    aligned bottom-right when a span's context is longer than its queries, as a continued chunk needs."""
    first, last, cu_q, cu_k, max_q, max_k = varlen
    H, D = k.shape[1], k.shape[2]
    if meta.gather_slots is None or not meta.gather_slots.numel():
        ks, vs = k[first:last], v[first:last]  # every context is the span itself: the rows as they are
    else:  # a continued span reads its context from the cache; fresh spans their own rows
        k_ctx = k_cache.view(-1, H, D).index_select(0, meta.gather_slots)  # [sum gathered ctx, Hkv, D]
        v_ctx = v_cache.view(-1, H, D).index_select(0, meta.gather_slots)
        pk, pv = [], []
        for s in meta.prefill:
            if s.gather_start < 0:
                rows = slice(s.q_start, s.q_start + s.q_len)
                pk.append(k[rows])
                pv.append(v[rows])
            else:
                ctx = slice(s.gather_start, s.gather_start + s.ctx_len)
                pk.append(k_ctx[ctx])
                pv.append(v_ctx[ctx])
        ks, vs = torch.cat(pk), torch.cat(pv)  # [sum ctx_len, Hkv, D]
    return torch.ops.aten._flash_attention_forward(
        q[first:last], ks, vs, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
    )[0]


# ------------------------------------------------------------------------------------ decode (Triton)
# stride_bt is the block-table width, which varies from step to step outside CUDA graphs: not specialised, so
# that a width divisible by 16 does not compile a second variant in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr, scale,
                         stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                         NUM_SPLITS, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    """Program (b, kv head, split): the GROUP q heads sharing a kv head are the rows of one tl.dot; the split
    walks its share of the context, BLOCK_N positions (several pages) per iteration, with an online softmax.
    NUM_SPLITS is a run-time argument (Triton specialises the value 1), so one compiled kernel serves every
    split count."""
    wait_for_kernel_ahead(GDC)
    launch_dependents(GDC)
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
                         D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    wait_for_kernel_ahead(GDC)
    launch_dependents(GDC)
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


# Split policy: (programs without splitting = batch x kv heads, at least) -> splits. Static per batch size,
# since CUDA graphs need fixed shapes; each split's share of the context adapts to the context at run time.
# Launch shape: positions per iteration, warps, software-pipelining stages. Both as the engine benchmark's
# sweep selected them on the H200 (kernel timed inside CUDA graphs, contexts 512..8192): 16 splits below
# 16 sequences of 8 kv heads, 4 up to 63 sequences, 1 from 64 on (there one program per (sequence, kv head)
# already fills the GPU and a split only adds the merge); 3 stages beat 2 by ~4% (docs/performance.md).
DECODE_SPLITS: tuple[tuple[int, int], ...] = ((0, 16), (128, 4), (512, 1))
DECODE_LAUNCH = {"block_n": 64, "num_warps": 4, "num_stages": 3}


def set_decode_policy(splits: tuple[tuple[int, int], ...] | None = None, **launch: int) -> None:
    """Replace the split table and/or launch shape (benchmarks; before CUDA graphs are captured)."""
    global DECODE_SPLITS
    if splits is not None:
        for _, n in splits:
            if n < 1 or n & (n - 1):
                raise ValueError(f"set_decode_policy.splits: split counts must be powers of two, got {n}")
        DECODE_SPLITS = tuple(sorted(splits))
    unknown = set(launch) - set(DECODE_LAUNCH)
    if unknown:
        raise ValueError(f"set_decode_policy: unknown launch keys {sorted(unknown)}")
    DECODE_LAUNCH.update(launch)


def default_num_splits(batch: int, num_kv_heads: int) -> int:
    """Splits for a decode batch: the table entry with the largest program threshold <= batch x kv heads."""
    programs, splits = batch * num_kv_heads, 1
    for threshold, n in DECODE_SPLITS:
        if programs >= threshold:
            splits = n
    return splits


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 num_splits: int | None = None) -> torch.Tensor:  # fmt: skip
    """q: [B, Hq, D]; caches [N, bs, Hkv, D]; block_tables [B, W] int32; seq_lens [B] int32 -> [B, Hq, D].
    Launch arguments left None follow DECODE_SPLITS / DECODE_LAUNCH."""
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    group, d_pad = Hq // Hkv, max(16, triton.next_power_of_2(D))
    block_n = DECODE_LAUNCH["block_n"] if block_n is None else block_n
    num_warps = DECODE_LAUNCH["num_warps"] if num_warps is None else num_warps
    num_stages = DECODE_LAUNCH["num_stages"] if num_stages is None else num_stages
    splits = default_num_splits(B, Hkv) if num_splits is None else num_splits
    assert splits & (splits - 1) == 0, f"num_splits must be a power of two, got {splits}"
    out = torch.empty_like(q) if out is None else out
    part = ml = out  # unused unless split
    if splits > 1:
        part = torch.empty(B, Hq, splits, d_pad, dtype=torch.float32, device=q.device)
        ml = torch.empty(B, Hq, splits, 2, dtype=torch.float32, device=q.device)
    pdl = model_pdl_args(q)
    _paged_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, ml, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=D, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_N=max(block_n, block_size), IEEE=q.dtype == torch.float32, num_warps=num_warps,
        num_stages=num_stages, **pdl,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(B, Hq)](part, ml, out, out.stride(0), out.stride(1), Hq, D=D, D_PAD=d_pad,
                                      NUM_SPLITS=splits, num_warps=4, **pdl)  # fmt: skip
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
    T = q.shape[0]
    varlen = _varlen_inputs(meta, q.device) if meta.prefill and _flash_ok(q) else None
    if varlen is not None and meta.block_tables is None and varlen[:2] == (0, T):
        return _prefill_flash(q, k, v, k_cache, v_cache, meta, scale, varlen).contiguous()  # pure prefill
    out = torch.empty_like(q)
    if varlen is not None:
        out[varlen[0] : varlen[1]] = _prefill_flash(q, k, v, k_cache, v_cache, meta, scale, varlen)
    elif meta.prefill:
        _prefill(q, k, v, k_cache, v_cache, meta, scale, out)
    if meta.block_tables is not None:
        num_dec = meta.block_tables.shape[0]
        if varlen is not None and varlen[:2] == (num_dec, T):  # the decode rows come first: write in place
            tables, lens = meta.block_tables, meta.seq_lens
            paged_decode(q[:num_dec], k_cache, v_cache, tables, lens, scale, out=out[:num_dec])
        else:
            out[meta.decode_rows] = paged_decode(q[meta.decode_rows], k_cache, v_cache, meta.block_tables,
                                                 meta.seq_lens, scale)  # fmt: skip
    return out
