"""Paged attention and the fused ops: each Triton kernel against its plain-torch reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1);
on the H200 the same tests run compiled, in bf16 too.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from loraplane.engine.model.attention import (  # noqa: E402
    AttentionMetadata,
    PrefillSpan,
    paged_attention,
    paged_decode,
    paged_decode_ref,
    write_kv,
)
from loraplane.engine.model.fused_ops import (  # noqa: E402
    model_pdl,
    rmsnorm,
    rope_and_store_kv,
    rope_ref,
    set_model_pdl,
    silu_mul,
)
from tests.kernels.pdl_producer import late_copy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _paged_cache(num_blocks, block_size, heads, dim, dtype):
    k = torch.randn(num_blocks, block_size, heads, dim, dtype=dtype, device=DEVICE)
    return k, torch.randn_like(k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "block_size", "D", "num_splits"),
    [(4, 2, 4, 64, 1), (9, 3, 16, 64, None), (8, 8, 16, 80, 4), (4, 2, 16, 64, 8)],
)
def test_paged_decode_matches_reference(dtype, hq, hkv, block_size, D, num_splits):
    torch.manual_seed(0)
    B = 5
    k_cache, v_cache = _paged_cache(48, block_size, hkv, D, dtype)
    seq_lens = torch.tensor([1, 7, 33, 70, 150], dtype=torch.int32, device=DEVICE)[:B]
    width = -(-int(seq_lens.max()) // block_size)
    blocks = list(range(48))
    random.Random(0).shuffle(blocks)
    tables = torch.tensor([blocks[:width] for _ in range(B)], dtype=torch.int32, device=DEVICE)
    tables = tables.roll(shifts=1, dims=1)  # different sequences, different block orders
    q = torch.randn(B, hq, D, dtype=dtype, device=DEVICE)
    ours = paged_decode(q, k_cache, v_cache, tables, seq_lens, D**-0.5, num_splits=num_splits)
    ref = paged_decode_ref(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, D**-0.5)
    assert rel_err(ours, ref) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 8])
def test_paged_decode_empty_rows_write_zeros(num_splits):
    k_cache, v_cache = _paged_cache(4, 16, 2, 64, torch.float32)
    q = torch.randn(2, 4, 64, device=DEVICE)
    out = paged_decode(q, k_cache, v_cache, torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
                       torch.tensor([0, 3], dtype=torch.int32, device=DEVICE), 0.125, num_splits=num_splits)  # fmt: skip
    assert torch.all(out[0] == 0) and torch.isfinite(out).all()


@pytest.mark.parametrize("use_triton", [False, True])
def test_write_kv_scatters_by_slot_and_skips_padding(use_triton):
    k_cache, v_cache = torch.zeros(2, 6, 4, 2, 8, device=DEVICE)
    k, v = torch.randn(3, 2, 8, device=DEVICE), torch.randn(3, 2, 8, device=DEVICE)
    slots = torch.tensor([5, 17, 2], device=DEVICE)
    write_kv(k, v, k_cache, v_cache, slots, triton_=use_triton)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    assert (flat_k != 0).sum() == (k != 0).sum()
    if use_triton:  # -1 marks a CUDA-graph padding row: nothing written
        write_kv(k, v, k_cache, v_cache, torch.tensor([-1, -1, -1], device=DEVICE), triton_=True)
        assert (flat_k != 0).sum() == (k != 0).sum()


def test_paged_attention_mixed_prefill_and_decode_rows():
    """A fresh prefill span, a continued span (context gathered from the cache) and decode-kernel rows."""
    torch.manual_seed(1)
    hq, hkv, D, bs = 4, 2, 32, 4
    k_cache, v_cache = torch.zeros(2, 32, bs, hkv, D, device=DEVICE)
    # history: sequence A has 6 cached tokens in blocks [3, 9]; B has 5 in [7, 1]
    hist = {"A": ([3, 9], 6), "B": ([7, 1], 5)}
    ks = {n: torch.randn(L + 4, hkv, D, device=DEVICE) for n, (_, L) in hist.items()}
    vs = {n: torch.randn(L + 4, hkv, D, device=DEVICE) for n, (_, L) in hist.items()}

    def slots(table, positions):
        return [table[p // bs] * bs + p % bs for p in positions]

    for n, (table, L) in hist.items():
        write_kv(ks[n][:L], vs[n][:L], k_cache, v_cache, torch.tensor(slots(table, range(L)), device=DEVICE))
    # step rows: fresh span (3 tokens) | A continues with 2 tokens | B decodes 1 token
    fresh_k, fresh_v = torch.randn(3, hkv, D, device=DEVICE), torch.randn(3, hkv, D, device=DEVICE)
    k = torch.cat([fresh_k, ks["A"][6:8], ks["B"][5:6]])
    v = torch.cat([fresh_v, vs["A"][6:8], vs["B"][5:6]])
    q = torch.randn(6, hq, D, device=DEVICE)
    step_slots = slots([20], range(3)) + slots([3, 9], [6, 7]) + slots([7, 1], [5])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(step_slots, device=DEVICE),
        prefill=[PrefillSpan(0, 3, 3, -1), PrefillSpan(3, 2, 8, 0)],
        gather_slots=torch.tensor(slots([3, 9], range(8)), device=DEVICE),
        decode_rows=torch.tensor([5], device=DEVICE),
        block_tables=torch.tensor([[7, 1]], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([6], dtype=torch.int32, device=DEVICE),
    )
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, D**-0.5)

    def causal_ref(qs, kk, vv):  # queries at the last len(qs) positions of kk
        g = hq // hkv
        kk, vv = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, kk) * D**-0.5
        n, L = qs.shape[0], kk.shape[0]
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
        return torch.einsum(
            "hqk,khd->qhd", scores.masked_fill(~mask.to(DEVICE), float("-inf")).softmax(-1), vv
        )

    ref = torch.cat([causal_ref(q[:3], fresh_k, fresh_v), causal_ref(q[3:5], ks["A"][:8], vs["A"][:8]),
                     causal_ref(q[5:], ks["B"][:6], vs["B"][:6])])  # fmt: skip
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rmsnorm_with_residual_matches_reference(dtype):
    x = torch.randn(5, 96, dtype=dtype, device=DEVICE)
    res = torch.randn(5, 96, dtype=dtype, device=DEVICE)
    w = torch.randn(96, dtype=dtype, device=DEVICE)
    ref_out, ref_res = rmsnorm(x, w, 1e-5, res.clone(), triton_=False)
    out, new_res = rmsnorm(x, w, 1e-5, res.clone(), triton_=True)
    assert rel_err(new_res, ref_res) < TOL[dtype] and rel_err(out, ref_out) < TOL[dtype]
    plain, _ = rmsnorm(x, w, 1e-5, triton_=True)
    assert rel_err(plain, rmsnorm(x, w, 1e-5, triton_=False)[0]) < TOL[dtype]


def test_model_pdl_is_a_switch_that_only_a_hopper_gpu_takes():
    """set_model_pdl returns the setting it replaced; where programmatic dependent launch is not there
    (a CPU tensor, the interpreter) the kernels launch as usual, with the same result."""
    x, w = torch.randn(4, 96, device=DEVICE), torch.randn(96, device=DEVICE)
    plain, _ = rmsnorm(x, w, 1e-5, triton_=True)
    old = set_model_pdl(True)
    try:
        assert set_model_pdl(True) is True and not model_pdl(torch.zeros(1))
        assert torch.equal(rmsnorm(x, w, 1e-5, triton_=True)[0], plain)
    finally:
        set_model_pdl(old)
    assert set_model_pdl(old) is old


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_silu_mul_matches_reference(dtype):
    gate_up = torch.randn(3, 3000, dtype=dtype, device=DEVICE)
    ref = torch.nn.functional.silu(gate_up[:, :1500].float()) * gate_up[:, 1500:].float()
    assert rel_err(silu_mul(gate_up, triton_=True), ref) < TOL[dtype]
    assert rel_err(silu_mul(gate_up, triton_=False), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "D"), [(4, 2, 16), (9, 3, 64), (8, 2, 80)])
def test_fused_rope_and_kv_store_matches_reference(dtype, hq, hkv, D):
    T, bs = 5, 4
    freqs = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, D, 2.0) / D)).to(DEVICE)
    cos, sin = freqs.cos(), freqs.sin()
    qkv = torch.randn(T, hq + 2 * hkv, D, dtype=dtype, device=DEVICE)
    pos = torch.tensor([0, 5, 63, 2, 9], device=DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 9], device=DEVICE)  # -1: a padding row, nothing stored
    caches = {}
    for use_triton in (False, True):
        x = qkv.clone()
        k_cache, v_cache = torch.zeros(2, 6, bs, hkv, D, dtype=dtype, device=DEVICE)
        s = slots if use_triton else slots.clamp(min=0).where(slots >= 0, 23)  # torch path: spare slot 23
        rope_and_store_kv(x, hq, hkv, pos, cos, sin, k_cache, v_cache, s, triton_=use_triton)
        caches[use_triton] = (x, k_cache.view(-1, hkv, D)[:23], v_cache.view(-1, hkv, D)[:23])
    ref_q = rope_ref(qkv[:, :hq], pos, cos, sin)
    ref_k = rope_ref(qkv[:, hq : hq + hkv], pos, cos, sin)
    for x, kc, vc in caches.values():
        assert rel_err(x[:, :hq], ref_q) < TOL[dtype] and rel_err(x[:, hq : hq + hkv], ref_k) < TOL[dtype]
        assert torch.equal(x[:, hq + hkv :], qkv[:, hq + hkv :])  # v is not rotated
        keep = slots >= 0
        assert torch.equal(kc[slots[keep]], x[keep, hq : hq + hkv])
        assert torch.equal(vc[slots[keep]], x[keep, hq + hkv :])


def _step_case(specs, hq, hkv, D, bs, dtype, device):
    """specs: per chunk (kind, history, new tokens): 'decode' (1 new), 'fresh' (no history) or 'cont'.
    Builds a paged cache holding each history, the step's rows in spec order, its metadata like the runner's,
    and the fp32 causal reference of every row."""
    k_cache = torch.randn(64, bs, hkv, D, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    blocks = list(range(64))
    random.Random(3).shuffle(blocks)
    rows_k, rows_v, slots, spans, gather, dec_rows, tables, lens, refs = [], [], [], [], [], [], [], [], []
    row, q_all = 0, []
    for kind, hist, n in specs:
        end = hist + n
        table = [blocks.pop() for _ in range(-(-end // bs))]
        ks = torch.randn(end, hkv, D, dtype=dtype, device=device)
        vs = torch.randn_like(ks)
        sl = [table[p // bs] * bs + p % bs for p in range(end)]
        k_cache.view(-1, hkv, D)[sl] = ks
        v_cache.view(-1, hkv, D)[sl] = vs
        q = torch.randn(n, hq, D, dtype=dtype, device=device)
        q_all.append(q)
        rows_k.append(ks[hist:])
        rows_v.append(vs[hist:])
        slots += sl[hist:]
        if kind == "decode":
            dec_rows.append(row)
            tables.append(table)
            lens.append(end)
        elif hist == 0:
            spans.append(PrefillSpan(row, n, n, -1))
        else:
            spans.append(PrefillSpan(row, n, end, len(gather)))
            gather += sl
        g = hq // hkv
        kk, vv = ks.float().repeat_interleave(g, 1), vs.float().repeat_interleave(g, 1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * D**-0.5
        mask = torch.arange(end, device=device)[None, :] <= torch.arange(hist, end, device=device)[:, None]
        refs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv))
        row += n
    width = max((len(t) for t in tables), default=0)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), prefill=spans)
    if gather:
        meta.gather_slots = torch.tensor(gather, device=device)
    if dec_rows:
        meta.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                         device=device)  # fmt: skip
        meta.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        meta.decode_rows = None if not spans else torch.tensor(dec_rows, device=device)
    return torch.cat(q_all), torch.cat(rows_k), torch.cat(rows_v), k_cache, v_cache, meta, torch.cat(refs)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (flash attention)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "specs",
    [
        [("fresh", 0, 37), ("fresh", 0, 64), ("fresh", 0, 5)],  # a pure prefill step: one varlen call
        [("decode", 40, 1), ("decode", 7, 1), ("cont", 45, 19), ("fresh", 0, 33)],  # decode rows first
        [("cont", 100, 1), ("cont", 17, 30), ("decode", 90, 1), ("fresh", 0, 12)],  # decode row in between
        [("decode", 16, 1), ("cont", 64, 64), ("cont", 3, 2)],  # continued spans only
    ],
)
def test_gpu_varlen_prefill_and_decode_rows_match_reference(dtype, specs):
    """On the GPU the prefill spans of a step run as one flash-attention call (bottom-right causal per span,
    grouped-query heads); decode rows that come first are written in place. Every row matches fp32 attention."""
    torch.manual_seed(5)
    for hq, hkv, D in [(8, 2, 128), (6, 3, 64)]:
        q, k, v, k_cache, v_cache, meta, ref = _step_case(specs, hq, hkv, D, 16, dtype, DEVICE)
        q, k, v = torch.cat([q, k, v], dim=1).split([hq, hkv, hkv], dim=1)  # views of one qkv
        out = paged_attention(q, k, v, k_cache, v_cache, meta, D**-0.5)
        assert out.shape == ref.shape and torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2, (hq, hkv, D)


def test_varlen_inputs_cover_contiguous_spans_only():
    """The varlen path needs the spans' rows as one run in order; otherwise each span runs on its own."""
    from loraplane.engine.model.attention import _varlen_inputs

    meta = AttentionMetadata(slot_mapping=torch.zeros(9, dtype=torch.int64),
                             prefill=[PrefillSpan(2, 3, 3, -1), PrefillSpan(5, 4, 10, 0)])  # fmt: skip
    first, last, cu_q, cu_k, max_q, max_k = _varlen_inputs(meta, torch.device("cpu"))
    assert (first, last, max_q, max_k) == (2, 9, 4, 10)
    assert cu_q.tolist() == [0, 3, 7] and cu_k.tolist() == [0, 3, 13]
    gap = AttentionMetadata(slot_mapping=torch.zeros(9, dtype=torch.int64),
                            prefill=[PrefillSpan(0, 3, 3, -1), PrefillSpan(4, 4, 4, -1)])  # fmt: skip
    assert _varlen_inputs(gap, torch.device("cpu")) is None


def test_decode_split_policy_follows_the_table_and_rejects_bad_entries():
    from loraplane.engine.model import attention

    saved, launch = attention.DECODE_SPLITS, dict(attention.DECODE_LAUNCH)
    try:
        attention.set_decode_policy(((0, 8), (64, 2), (256, 1)), num_stages=2)
        assert [attention.default_num_splits(b, 8) for b in (1, 7, 8, 31, 32, 64)] == [8, 8, 2, 2, 1, 1]
        assert attention.DECODE_LAUNCH["num_stages"] == 2
        with pytest.raises(ValueError, match="powers of two"):
            attention.set_decode_policy(((0, 3),))
        with pytest.raises(ValueError, match="unknown launch keys"):
            attention.set_decode_policy(warps=8)
    finally:
        attention.DECODE_SPLITS = saved
        attention.DECODE_LAUNCH.update(launch)


@pytest.mark.gpu
def test_gpu_pdl_decoder_kernels_wait_for_the_kernel_ahead():
    """set_model_pdl: in one graph, a producer that lets the next kernel start before it writes fills qkv
    just ahead of RoPE + KV store, and paged decode (split, then merged) reads the rotated q and the stored
    KV. Before each replay qkv and the new tokens' KV rows hold NaN: every replay is finite and equals the
    same graph captured without programmatic dependent launch, bit for bit."""
    torch.manual_seed(0)
    B, hq, hkv, D, bs, width = 8, 8, 2, 64, 16, 7
    k0, v0 = _paged_cache(64, bs, hkv, D, torch.bfloat16)
    seq_lens = torch.randint(1, width * bs, (B,), dtype=torch.int32, device=DEVICE)
    tables = torch.randperm(64, device=DEVICE)[: B * width].view(B, width).int()  # no block shared
    pos = (seq_lens - 1).long()
    slots = tables.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    freqs = torch.outer(torch.arange(128.0), 1.0 / 10000 ** (torch.arange(0, D, 2.0) / D)).to(DEVICE)
    cos, sin = freqs.cos(), freqs.sin()
    qkv_src = torch.randn(B, hq + 2 * hkv, D, dtype=torch.bfloat16, device=DEVICE)
    qkv, out = torch.empty_like(qkv_src), torch.empty(B, hq, D, dtype=torch.bfloat16, device=DEVICE)
    k_cache, v_cache = k0.clone(), v0.clone()

    def step():
        late_copy(qkv, qkv_src)
        rope_and_store_kv(qkv, hq, hkv, pos, cos, sin, k_cache, v_cache, slots)
        paged_decode(qkv[:, :hq], k_cache, v_cache, tables, seq_lens, D**-0.5, out=out)

    def replayed(pdl: bool) -> list[torch.Tensor]:
        old = set_model_pdl(pdl)
        try:
            step()  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        finally:
            set_model_pdl(old)
        outs = []
        for _ in range(20):
            k_cache.copy_(k0)
            v_cache.copy_(v0)
            for cache in (k_cache, v_cache):
                cache.view(-1, hkv, D)[slots] = float("nan")
            qkv.fill_(float("nan"))
            graph.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        return outs

    plain, pdl = replayed(False), replayed(True)
    assert all(torch.isfinite(o).all() for o in pdl)
    assert all(torch.equal(a, b) for a, b in zip(plain, pdl, strict=True))
