"""lora_apply_many: several single-slice pools sharing x and one slot numbering, one launch pair.

The engine keeps one pool per PEFT module (q, k, v, ...), so an adapter without k_proj has no slot in
the k pool (rank 0 there). The reference is one plain-torch ``lora_apply`` per pool on its columns.
"""

from __future__ import annotations

import os

import pytest
import torch

from loraplane.kernels import LoRABatchMeta, LoRAPool, ModuleSpec, lora_apply, lora_apply_many
from tests.numerics import assert_close_sums

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
IN = 40
WIDTHS = {"q": 48, "k": 16, "v": 16, "gate": 80, "up": 80}
# slot -> rank per module (absent: the adapter does not target that module)
ADAPTERS = {0: {"q": 8, "k": 8, "v": 8, "gate": 8, "up": 8}, 1: {"q": 16, "v": 16}, 2: {"k": 4, "up": 12}}
TERMS = IN + 16  # x @ A^T over IN, then @ B^T over the rank (16 at most)


def _pools(device: str, layers: int = 2, dtype=torch.float32):
    g = torch.Generator().manual_seed(11)
    pools = {}
    for m, w in WIDTHS.items():
        spec = {m: ModuleSpec(IN, (w,))}
        budget = 64 * LoRAPool.page_bytes_for(spec, layers, 1, dtype)
        pools[m] = LoRAPool(spec, layers, budget, page_rank=1, max_rank=16, max_adapters=8, dtype=dtype,
                            device=device)  # fmt: skip
    for slot, ranks in ADAPTERS.items():
        for m, r in ranks.items():
            pools[m].allocate(r, 0.25 + slot + 0.5 * list(WIDTHS).index(m), slot=slot)
            for layer in range(layers):
                a = torch.randn(r, IN, generator=g)
                pools[m].write(slot, layer, m, 0, a, torch.randn(WIDTHS[m], r, generator=g))
    ranks = [max(r.values()) for _, r in sorted(ADAPTERS.items())]
    return pools, ranks


def _targets(pools, names, gap: int = 0):
    out, c = [], 0
    for m in names:
        out.append((pools[m], m, c))
        c += WIDTHS[m] + gap
    return out, c


def _reference(y, x, targets, layer, meta):
    y = y.clone()
    for pool, m, c0 in targets:
        lora_apply(y[:, c0 : c0 + WIDTHS[m]], x, pool, layer, m, meta, backend="torch")
    return y


REQUESTS = {
    "decode": ([(0, 1), (1, 1), (-1, 1), (2, 1), (1, 1), (0, 1)], 16, False),
    "captured": ([(2, 1), (0, 1), (1, 1), (-1, 1)], 16, True),
    "prefill": ([(1, 37), (-1, 5), (0, 70), (2, 9)], 64, False),
}


def check_pools_sharing_x(device: str, names: tuple[str, ...]) -> LoRABatchMeta:
    """q, k, v (gate, up; or k, q with a gap between them) from pools of their own, over two layers of
    captured metadata with a base-only row: ``lora_apply_many`` equals the float64 reference. Returns the
    metadata (its plans show which kernels ran)."""
    pools, ranks = _pools(device)
    reqs = [(2, 1), (0, 1), (1, 1), (-1, 1), (0, 1)]
    meta = LoRABatchMeta(8, device, tile_m=16, capture=True, max_rank=16).build(reqs, ranks)
    targets, width = _targets(pools, names, gap=8 if names == ("k", "q") else 0)
    for layer in range(2):
        x = torch.randn(8, 40, device=device)
        y = torch.randn(8, width + 5, device=device)
        want = _reference(y, x, targets, layer, meta)
        got = lora_apply_many(y.clone(), x, targets, layer, meta, backend="triton")
        assert_close_sums(got, want, TERMS)
    return meta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("names", [("q", "k", "v"), ("gate", "up"), ("k", "q")], ids=["qkv", "gate_up", "kq"])
@pytest.mark.parametrize("kind", list(REQUESTS))
def test_one_launch_pair_equals_one_apply_per_pool(device, names, kind):
    pools, ranks = _pools(device)
    reqs, tile_m, capture = REQUESTS[kind]
    tokens = sum(n for _, n in reqs)
    meta = LoRABatchMeta(tokens + 3, device, tile_m=tile_m, capture=capture, max_rank=16).build(reqs, ranks)
    gap = 8 if names == ("k", "q") else 0  # columns between the slices stay as they were
    targets, width = _targets(pools, names, gap)
    for layer in range(2):  # the second layer replays the first one's launch shapes
        x = torch.randn(tokens + 3 if capture else tokens, IN, device=device)
        y = torch.randn(x.shape[0], width + 5, device=device)
        want = _reference(y, x, targets, layer, meta)
        got = lora_apply_many(y.clone(), x, targets, layer, meta, backend="triton")
        assert_close_sums(got, want, TERMS)
    assert any(k[0] == "pools" for k in meta.plans)


def test_torch_path_and_bad_targets():
    pools, ranks = _pools("cpu")
    meta = LoRABatchMeta(8).build([(0, 2), (1, 3)], ranks)
    targets, width = _targets(pools, ("q", "k", "v"))
    x = torch.randn(5, IN)
    y = torch.randn(5, width)
    got = lora_apply_many(y.clone(), x, targets, 1, meta, backend="torch")
    assert_close_sums(got, _reference(y, x, targets, 1, meta), TERMS)
    overlap = [(pools["q"], "q", 0), (pools["k"], "k", 40)]
    with pytest.raises(ValueError, match="overlap"):
        lora_apply_many(y, x, overlap, 0, meta)
    with pytest.raises(ValueError, match="fit"):
        lora_apply_many(y, x, [(pools["q"], "q", width)], 0, meta)
    with pytest.raises(ValueError, match="x must be"):
        lora_apply_many(y, torch.randn(5, IN + 1), targets, 0, meta)


@pytest.mark.parametrize("device", DEVICES)
def test_pools_with_other_row_strides_take_one_launch_pair_each(device):
    """A pool whose A rows are views with another stride (memory the caller lays out) cannot share the
    pooled shrink's single row stride: the call falls back to one lora_apply per pool, same result."""
    pools, ranks = _pools(device)
    for layer in range(2):
        a = pools["k"].a[(layer, "k")]
        wide = torch.full((1, a.shape[1], IN + 8), float("nan"), device=device)
        wide[:, :, :IN] = a
        pools["k"].a[(layer, "k")] = wide[:, :, :IN]
    meta = LoRABatchMeta(8, device).build([(0, 3), (2, 2), (1, 1)], ranks)
    targets, width = _targets(pools, ("q", "k", "v"))
    x = torch.randn(6, IN, device=device)
    y = torch.randn(6, width, device=device)
    got = lora_apply_many(y.clone(), x, targets, 1, meta, backend="triton")
    assert_close_sums(got, _reference(y, x, targets, 1, meta), TERMS)
    assert not any(k[0] == "pools" for k in meta.plans)


def test_eager_metadata_keeps_one_shrink_buffer_whatever_the_step_sizes():
    """An eager metadata serves a new token count every step: its shrink buffers must not pile up one per
    count (a server would grow without bound); a captured one keeps each shape's buffer at one address."""
    eager = LoRABatchMeta(4096)
    sizes = [7, 300, 64, 1000, 3, 999]
    views = [eager.scratch_f32((2, 3, t, 64), torch.device("cpu")) for t in sizes]
    assert eager.scratch == {}
    assert [tuple(v.shape) for v in views] == [(2, 3, t, 64) for t in sizes]
    assert len({v.untyped_storage().data_ptr() for v in views[3:]}) == 1  # one buffer once grown
    assert views[-1].untyped_storage().nbytes() == 2 * 3 * 1000 * 64 * 4
    captured = LoRABatchMeta(64, capture=True, max_rank=64)
    a = captured.scratch_f32((2, 3, 64, 64), torch.device("cpu"))
    b = captured.scratch_f32((2, 3, 64, 64), torch.device("cpu"))
    assert a.data_ptr() == b.data_ptr() and len(captured.scratch) == 1


@pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
def test_later_layers_skip_the_checks_only_for_the_same_arguments():
    """After a step's first layer, a call that reuses its plan checks only the layer; any other argument
    (another dtype, a wider y, a layer out of range) is checked in full and refused as on a first call;
    a storing call still zeroes the columns of rows without an adapter at every layer."""
    pools, ranks = _pools("cpu")
    meta = LoRABatchMeta(8, "cpu").build([(0, 3), (-1, 2), (1, 1)], ranks)
    targets, width = _targets(pools, ("q", "k", "v"))
    x, y = torch.randn(6, IN), torch.randn(6, width)
    lora_apply_many(y.clone(), x, targets, 0, meta, backend="triton")
    plans = len(meta.plans)
    with pytest.raises(ValueError, match="layer must be in"):
        lora_apply_many(y.clone(), x, targets, 2, meta, backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        lora_apply_many(y.clone(), x.double(), targets, 1, meta, backend="triton")
    with pytest.raises(ValueError, match="fit"):
        lora_apply_many(y[:, :20].clone(), x, targets, 1, meta, backend="triton")
    got = lora_apply_many(y.clone(), x, targets, 1, meta, backend="triton")
    assert_close_sums(got, _reference(y, x, targets, 1, meta), TERMS)
    assert len(meta.plans) == plans  # the same plan served layer 1
    for layer in range(2):  # storing: the base-only rows' columns hold zeros, not y's old values
        got = lora_apply_many(torch.full_like(y, float("nan")), x, targets, layer, meta, backend="triton",
                              store=True)  # fmt: skip
        want = _reference(torch.zeros_like(y), x, targets, layer, meta)
        assert_close_sums(got, want, TERMS)
