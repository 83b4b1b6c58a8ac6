"""``store=True``: the expand writes the delta without reading y, for a caller whose GEMM adds on top.

y starts as NaN: a kernel that reads it (on the first rank chunk) leaves NaN behind and fails. The
expected delta is the float64 reference minus its starting y. Rows without an adapter, or whose adapter
lacks the module, get no work from the expand: their columns must come out as 0, not y's old contents.
"""

from __future__ import annotations

import os

import pytest
import torch

from loraplane.kernels import LoRABatchMeta, covers_every_row, lora_apply, lora_apply_many
from loraplane.kernels.triton_ops import LaunchConfig
from tests.kernels.lora_case import make_case, rel_err
from tests.kernels.test_many import _pools, _targets

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET=1")),
]
MIXED = (8, 16, 32, 64, 128, 12)
# None: pick_config's shape. The others: rank chunks of 16 rows (a rank-128 tile stores once and adds
# seven times) and a column chunk that does not divide the widths (the masked, RAGGED loop).
CONFIGS = {
    "heuristic": None,
    "rank-chunks": LaunchConfig(block_r=16, shrink_block_r=16, block_k=32, block_n=16, n_chunk=16, split_k=2),
    "ragged": LaunchConfig(block_r=16, shrink_block_r=16, block_k=32, block_n=32, n_chunk=32),
}


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("module,tile_m", [("gate_up", 64), ("qkv", 16), ("down", 64)])
def test_store_writes_the_delta_without_reading_y(backend, config, module, tile_m):
    device = "cuda" if backend == "cuda" else "cpu"
    case = make_case(num_tokens=37, num_adapters=5, ranks=MIXED, module=module, tokens_per_request=4,
                     no_adapter_frac=0.0, tile_m=tile_m, device=device)  # fmt: skip
    assert covers_every_row(case.meta, case.pool, 37)
    delta = case.ref - case.y0.cpu().double()  # [T, out_total]
    y = torch.full_like(case.y0, float("nan"))
    lora_apply(y, case.x, case.pool, 0, module, case.meta, backend="auto" if device == "cuda" else backend,
               config=CONFIGS[config], store=True)  # fmt: skip
    y = y.cpu()
    assert not torch.isnan(y).any(), f"seed={case.seed}: y was read or a column was not written"
    err = rel_err(y, delta)
    assert err < (1e-3 if device == "cuda" else 1e-5), f"seed={case.seed}: rel err {err:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_then_gemm_equals_gemm_then_add(backend):
    """The engine's delta-first order (store, then ``y.addmm_(x, W^T)``) gives the usual result."""
    case = make_case(num_tokens=20, num_adapters=3, ranks=MIXED, module="down", tokens_per_request=5,
                     no_adapter_frac=0.0, tile_m=64)  # fmt: skip
    w = torch.randn(case.y0.shape[1], case.x.shape[1]) / 10  # [out, in]
    first = case.x @ w.t()
    lora_apply(first, case.x, case.pool, 0, "down", case.meta, backend=backend)
    stored = torch.full_like(case.y0, float("nan"))
    lora_apply(stored, case.x, case.pool, 0, "down", case.meta, backend=backend, store=True)
    stored.addmm_(case.x, w.t())
    torch.testing.assert_close(stored, first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_zeroes_rows_without_an_adapter(backend):
    """A step with base-only rows cannot be covered by the storing expand alone: those rows' columns are
    zeroed (the delta is 0 there), the others hold the delta."""
    case = make_case(num_tokens=48, num_adapters=2, ranks=(8, 16), module="qkv", no_adapter_frac=0.5)
    rows = case.adapter_rows()  # 47 rows drawn base-only at 1/2 each: all with an adapter at 2^-47
    assert not rows.all() and not covers_every_row(case.meta, case.pool, 48)
    y = torch.full_like(case.y0, float("nan"))
    lora_apply(y, case.x, case.pool, 0, "qkv", case.meta, backend=backend, store=True)
    assert torch.equal(y[~rows], torch.zeros_like(y[~rows]))
    err = rel_err(y[rows], (case.ref - case.y0.double())[rows])
    assert err < 1e-5, f"seed={case.seed}: rel err {err:.2e}"


def test_store_refuses_captured_or_base_launches():
    full = make_case(num_tokens=6, num_adapters=2, ranks=(8,), module="down", no_adapter_frac=0.0)
    with pytest.raises(ValueError, match="without base"):
        lora_apply(full.y0.clone(), full.x, full.pool, 0, "down", full.meta, store=True, base=lambda: None)
    padded = make_case(num_tokens=6, num_adapters=2, ranks=(8,), module="down", no_adapter_frac=0.0,
                       capture=True, capacity=16)  # fmt: skip
    with pytest.raises(ValueError, match="without base"):
        lora_apply(padded.y0.clone(), padded.x, padded.pool, 0, "down", padded.meta, store=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_across_pools(backend):
    """gate, up from pools of their own (one launch pair): both slices written, neither read. An adapter
    without ``gate`` (slot 2): its rows' gate columns are zeroed."""
    pools, ranks = _pools("cpu")
    targets, width = _targets(pools, ("gate", "up"))
    meta = LoRABatchMeta(64, "cpu", tile_m=64).build([(0, 30), (0, 9)], ranks)  # slot 0 has gate and up
    x = torch.randn(39, 40)
    ref = torch.zeros(39, width)
    for pool, m, c0 in targets:
        lora_apply(ref[:, c0 : c0 + pool.modules[m].out_dims[0]], x, pool, 1, m, meta, backend="torch")
    y = torch.full((39, width), float("nan"))
    lora_apply_many(y, x, targets, 1, meta, backend=backend, store=True)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    meta.build([(0, 30), (2, 9)], ranks)  # slot 2 has up but no gate: its rows' gate columns are 0
    y = torch.full((39, width), float("nan"))
    lora_apply_many(y, x, targets, 1, meta, backend=backend, store=True)
    ref = torch.zeros(39, width)
    for pool, m, c0 in targets:
        lora_apply(ref[:, c0 : c0 + pool.modules[m].out_dims[0]], x, pool, 1, m, meta, backend="torch")
    assert torch.equal(y[30:, :80], torch.zeros(9, 80))
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
