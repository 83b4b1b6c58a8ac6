"""lora_apply / lora_shrink against a float64 reference, on the torch path and the Triton kernels.

On CPU the Triton kernels run in the interpreter (fp32 and fp16: it mishandles bf16); on a GPU the
``gpu`` tests add bf16 and larger shapes. Bands are relative Frobenius norms over all checked rows.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from loraplane.kernels import lora_apply, lora_expand, lora_shrink
from loraplane.kernels.launch_config import set_capture_policy
from loraplane.kernels.triton_ops import LaunchConfig, pick_config, shrink_triton
from tests.kernels.lora_case import make_case, rel_err

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
BAND = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
MIXED = (8, 16, 32, 64, 128, 12)

# (num_tokens, num_adapters, ranks, module, tokens_per_request, tile_m)
CASES = [
    (1, 1, (16,), "q", 1, 16),
    (3, 2, (8, 128), "qkv", 1, 16),
    (64, 64, MIXED, "qkv", 1, 16),
    (64, 5, MIXED, "gate_up", 7, 16),
    (257, 13, MIXED, "down", 20, 64),
    (257, 3, (64, 8), "qkv", 64, 64),
]
SLOW_CASES = [(1000, 64, MIXED, "qkv", 9, 64), (1000, 40, MIXED, "gate_up", 1, 16)]


def _check(case, y, dtype):
    rows = case.adapter_rows()
    y = y.cpu()
    assert torch.isnan(y[~rows]).all(), f"seed={case.seed}: a base-only row was written"
    assert not torch.isnan(y[rows]).any(), f"seed={case.seed}: NaN in an adapter row"
    err = rel_err(y[rows], case.ref[rows])
    assert err < BAND[dtype], f"seed={case.seed}: rel err {err:.2e} over {BAND[dtype]:.0e}"


def _run(case, backend, config=None):
    y = case.y0.clone()
    lora_apply(y, case.x, case.pool, 0, case.module, case.meta, backend=backend, config=config)
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,n,ranks,module,per_req,tile_m", CASES + SLOW_CASES)
def test_torch_path(T, n, ranks, module, per_req, tile_m, dtype):
    case = make_case(
        num_tokens=T, num_adapters=n, ranks=ranks, module=module, tokens_per_request=per_req, dtype=dtype
    )
    _check(case, _run(case, "torch"), dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,n,ranks,module,per_req,tile_m", CASES)
def test_triton_interpreted(T, n, ranks, module, per_req, tile_m, dtype):
    case = make_case(
        num_tokens=T, num_adapters=n, ranks=ranks, module=module, tokens_per_request=per_req, dtype=dtype,
        tile_m=tile_m,
    )  # fmt: skip
    _check(case, _run(case, "triton"), dtype)


@needs_interpreter
@pytest.mark.slow
@pytest.mark.parametrize("T,n,ranks,module,per_req,tile_m", SLOW_CASES)
def test_triton_interpreted_large(T, n, ranks, module, per_req, tile_m):
    case = make_case(
        num_tokens=T, num_adapters=n, ranks=ranks, module=module, tokens_per_request=per_req, tile_m=tile_m
    )
    _check(case, _run(case, "triton"), torch.float32)


CONFIGS = {
    "split4-strided": LaunchConfig(
        block_r=16, shrink_block_r=16, block_k=32, block_n=16, n_chunk=16, split_k=4, shrink_programs=3,
        expand_programs=5,
    ),
    "split2-chunk32": LaunchConfig(block_r=32, shrink_block_r=32, block_k=64, block_n=16, n_chunk=32, split_k=2),
    "fullrank": LaunchConfig(block_r=128, shrink_block_r=128, block_k=16, block_n=16, n_chunk=16, expand_programs=1),
    "fused-chunked-rank": LaunchConfig(block_r=16, block_k=32, block_n=16, n_chunk=16, fused=True, expand_programs=3),
    "fused-fullrank": LaunchConfig(block_r=128, block_k=64, block_n=32, n_chunk=32, fused=True),
}  # fmt: skip


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=needs_interpreter), pytest.param("cuda", marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_triton_launch_configs(name, device):
    """Split-K planes, grid-stride loops over tiles, column chunks, rank chunks and the fused
    shrink-in-expand all give the same answer."""
    case = make_case(
        num_tokens=20, num_adapters=6, ranks=MIXED, module="down", tokens_per_request=3, device=device
    )
    y = _run(case, "triton", CONFIGS[name])
    _check(case, y, torch.float32) if device == "cpu" else _check_band(case, y, 1e-3)


@needs_interpreter
@pytest.mark.parametrize("ranks,max_rank", [(MIXED, 128), ((8, 16, 12), 16)], ids=["bound128", "bound16"])
def test_triton_captured_meta_with_padding_rows(ranks, max_rank):
    """Graph-mode metadata: grid bounded by the capacity, rows past num_tokens untouched; a rank bound
    of 16 gives the narrow kernels only."""
    case = make_case(num_tokens=9, num_adapters=4, ranks=ranks, capture=True, capacity=16, max_rank=max_rank)
    _check(case, _run(case, "triton"), torch.float32)


@needs_interpreter
@pytest.mark.parametrize(
    "policy",
    [
        dict(tile_programs=3),
        dict(tile_programs=2, n_chunk=16, k_per_program=32),
        dict(n_chunk=64, k_per_program=16),
    ],
    ids=["walk3", "walk2-chunk16-k32", "chunk64-k16"],
)
def test_triton_captured_launch_policy_same_result(policy):
    """Captured launches under a CapturePolicy: fewer programs than tile slots (each walks several), other
    column chunks and split-K; same result, rows past the batch untouched; uncaptured launches ignore it."""
    case = make_case(num_tokens=9, num_adapters=4, ranks=MIXED, capture=True, capacity=16, max_rank=128)
    spec = case.pool.modules["qkv"]
    old = set_capture_policy(decode=False, **policy)  # the general kernels' launch fields
    try:
        cfg = pick_config(case.meta, spec.in_dim, spec.out_dims, torch.float32)
        assert cfg.tile_programs == policy.get("tile_programs", 0)
        if "n_chunk" in policy:
            assert cfg.n_chunk <= policy["n_chunk"]
        _check(case, _run(case, "triton"), torch.float32)
        plain = make_case(num_tokens=9, num_adapters=4, ranks=MIXED)
        assert pick_config(plain.meta, spec.in_dim, spec.out_dims, torch.float32).tile_programs == 0
    finally:
        set_capture_policy(**dataclasses.asdict(old))
    with pytest.raises(ValueError, match="CapturePolicy.n_chunk"):
        set_capture_policy(n_chunk=24)


@needs_interpreter
def test_shrink_writes_every_read_entry():
    """v is poisoned with NaN; every (plane, slice, adapter token, j < rank) entry must be written."""
    case = make_case(num_tokens=12, num_adapters=5, ranks=MIXED, module="qkv", tokens_per_request=2)
    spec = case.pool.modules["qkv"]
    cfg = LaunchConfig(block_r=16, block_k=32, n_chunk=16, block_n=16, split_k=2)
    v = torch.full((2, spec.num_slices, 12, 128), float("nan"))
    shrink_triton(
        case.x, case.pool.a[(0, "qkv")], case.pool.page_table, case.pool.ranks, case.meta, 8, 128, cfg, v
    )
    total = v.sum(0)
    for t, slot in enumerate(case.meta.token_slot[:12].tolist()):
        if slot < 0:
            continue
        r = case.dense[slot][0]
        assert not torch.isnan(total[:, t, :r]).any(), f"seed={case.seed}: unwritten v at token {t}"
        err = rel_err(total[:, t, :r], case.v_ref[:, t, :r])
        assert err < 1e-5, f"seed={case.seed}: v rel err {err:.2e} at token {t}"


def test_base_only_batch_touches_nothing():
    case = make_case(num_tokens=5, num_adapters=1, ranks=(8,), no_adapter_frac=1.0)
    for backend in ("torch", "triton") if INTERPRET else ("torch",):
        y = _run(case, backend)
        assert torch.isnan(y).all()


def test_pick_config_depends_on_capacity_only_when_captured():
    a = make_case(num_tokens=4, num_adapters=1, ranks=(8,), capture=True, capacity=32)
    b = make_case(num_tokens=30, num_adapters=7, ranks=(128,), capture=True, capacity=32)
    spec = a.pool.modules["qkv"]
    assert pick_config(a.meta, spec.in_dim, spec.out_dims, torch.float32) == pick_config(
        b.meta, spec.in_dim, spec.out_dims, torch.float32
    )


def test_bad_inputs_name_the_field():
    case = make_case(num_tokens=4, num_adapters=2, ranks=(8,))
    with pytest.raises(ValueError, match="y must be"):
        lora_apply(case.y0[:, :8], case.x, case.pool, 0, "qkv", case.meta)
    with pytest.raises(KeyError, match="module"):
        lora_apply(case.y0, case.x, case.pool, 0, "nope", case.meta)
    with pytest.raises(ValueError, match="dtype"):
        lora_apply(case.y0.half(), case.x.half(), case.pool, 0, "qkv", case.meta)
    with pytest.raises(ValueError, match="backend"):
        lora_apply(case.y0, case.x, case.pool, 0, "qkv", case.meta, backend="cuda")


GPU_CASES = [
    (1, 1, (16,), "q", 1, 16, True),
    (2, 2, MIXED, "gate_up", 1, 16, True),
    (3, 3, MIXED, "qkv", 1, 16, True),
    (64, 64, MIXED, "qkv", 1, 16, True),
    (257, 64, MIXED, "gate_up", 1, 16, True),
    (257, 13, MIXED, "down", 20, 64, False),
    (1000, 64, MIXED, "qkv", 16, 64, False),
    (1000, 40, MIXED, "gate_up", 1, 16, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("T,n,ranks,module,per_req,tile_m,capture", GPU_CASES)
def test_triton_gpu(T, n, ranks, module, per_req, tile_m, capture, dtype):
    case = make_case(
        num_tokens=T, num_adapters=n, ranks=ranks, module=module, tokens_per_request=per_req, dtype=dtype,
        device="cuda", tile_m=tile_m, capture=capture,
    )  # fmt: skip
    y = _run(case, "auto")
    torch.cuda.synchronize()
    band = {**BAND, torch.float32: 1e-3}  # tf32 is off for fp32 ('ieee'), keep a margin for reductions
    _check(case, y, dtype) if dtype != torch.float32 else _check_band(case, y, band[dtype])


def _check_band(case, y, band):
    rows = case.adapter_rows()
    y = y.cpu()
    assert torch.isnan(y[~rows]).all()
    err = rel_err(y[rows], case.ref[rows])
    assert err < band, f"seed={case.seed}: rel err {err:.2e}"


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_shrink_then_expand_pair(backend):
    """The two-step API (engine may reuse one v for several projections) equals lora_apply."""
    case = make_case(num_tokens=10, num_adapters=3, ranks=MIXED, module="gate_up", tokens_per_request=2)
    v = lora_shrink(case.x, case.pool, 0, "gate_up", case.meta, backend=backend)
    y = lora_expand(case.y0.clone(), v, case.pool, 0, "gate_up", case.meta, backend=backend)
    _check(case, y, torch.float32)
