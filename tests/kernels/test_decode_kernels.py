"""The decode-shaped kernels (triton_decode; ``CapturePolicy(decode=True)``): the same result as the
plain-torch reference for packed modules, pools sharing one input, any width and slice start, mixed ranks,
tiles of one token (the vector path) and of several (the ``tl.dot`` path), and base-only rows; on the GPU,
inside a CUDA graph replayed with new batches, as the engine's decode step does.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from loraplane.kernels import LoRABatchMeta, ModuleSpec, fast_launch, lora_apply
from loraplane.kernels.launch_config import (
    CapturePolicy,
    LaunchConfig,
    capture_policy,
    pick_config,
    set_capture_policy,
)
from loraplane.kernels.pdl import pdl_available
from loraplane.kernels.triton_decode import _shrink_decode_kernel, decode_split
from tests.kernels.graph_replay import replay_checked
from tests.kernels.lora_case import make_case
from tests.kernels.test_many import check_pools_sharing_x
from tests.kernels.test_one_launch import _dtype
from tests.kernels.test_ops import MIXED, _check, _run
from tests.kernels.width_case import Bank, check

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=[True, False], ids=["dot", "vector"])
def decode(request):
    """Captured launches take the decode-shaped kernels, with small blocks so that the tests' small
    shapes still span several v planes and column blocks; tiles of several tokens by ``tl.dot`` or a
    token at a time."""
    old = capture_policy()
    set_capture_policy(**{**dataclasses.asdict(old), "decode": True, "fused": False, "decode_k": 32,
                          "decode_n": 16, "decode_dot": request.param})  # fmt: skip
    try:
        yield
    finally:
        set_capture_policy(**dataclasses.asdict(old))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("module", ["q", "qkv", "gate_up", "down"])
@pytest.mark.parametrize("per_req", [1, 5], ids=["one-token-tiles", "shared-tiles"])
def test_packed_modules_mixed_ranks_and_base_rows(decode, device, module, per_req):
    """Ranks 8-128 and 12 in one batch, a fifth of the rows base-only (NaN there must stay NaN); tiles of
    one token, or of five tokens of one adapter; every packed slice lands at its columns."""
    case = make_case(num_tokens=24, num_adapters=10 if per_req == 1 else 4, ranks=MIXED, module=module,
                     tokens_per_request=per_req, capture=True, capacity=32, dtype=_dtype(device),
                     device=device)  # fmt: skip
    spec = case.pool.modules[module]
    cfg = pick_config(case.meta, spec.in_dim, spec.out_dims, case.x.dtype)
    assert cfg.decode and decode_split(spec.in_dim, cfg.block_k) > 1
    _check(case, _run(case, "triton"), _dtype(device))
    assert any(p.shrink is not None and p.cfg.decode for p in case.meta.plans.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("names", [("q", "k", "v"), ("gate", "up"), ("k", "q")], ids=["qkv", "gate_up", "kq"])
def test_pools_sharing_x(decode, device, names):
    """q, k, v (gate, up) from pools of their own; an adapter without a module has rank 0 in that pool
    and costs it nothing; a gap between slices stays as it was."""
    meta = check_pools_sharing_x(device, names)
    assert all(p.cfg.decode for k, p in meta.plans.items() if k[0] == "pools")


@pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("width,start", [(17, 3), (107, 0), (2049, 5)])
@pytest.mark.parametrize("per_req", [1, 3])
def test_any_width_and_start(decode, width, start, per_req):
    """Widths that no column block divides (the masked last block) and slices that start anywhere in y;
    12 adapters for 12 rows (one-token tiles) or 4 (tiles of three)."""
    spec = ModuleSpec(40, (width,), slice_starts=(start,), y_width=start + width + 5)
    bank = Bank(spec, (1, 8, 37, 64) * (3 if per_req == 1 else 1), torch.float32)
    b = bank.batch(bank.requests(12, per_req), capacity=16, capture=True)
    y = b.y0.clone()
    lora_apply(y, b.x, bank.pool, 0, "m", b.meta, backend="triton")
    check(bank, b, y)


def test_policy_fields_are_checked():
    for bad in (
        {"decode_k": 24},
        {"decode_n": 8},
        {"decode": 1},
        {"decode_dot": "yes"},
        {"pdl": 1},
        {"decode_warps": 3},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CapturePolicy(**bad)
    with pytest.raises(ValueError, match="pdl"):
        LaunchConfig(pdl=True)  # the general kernels are never launched that way


def test_pdl_rides_on_captured_decode_launches_only(decode):
    """``CapturePolicy(pdl=True)`` reaches the decode launches' configs; on a CPU tensor (the interpreter)
    the launch is an ordinary one, with the same result."""
    set_capture_policy(**{**dataclasses.asdict(capture_policy()), "pdl": True})
    captured = LoRABatchMeta(64, "cpu", tile_m=16, capture=True, max_rank=16)
    assert pick_config(captured, 64, (32,), torch.float32).pdl
    eager = LoRABatchMeta(64, "cpu", tile_m=16, capture=False, max_rank=16)
    assert not pick_config(eager, 64, (32,), torch.float32).pdl
    if INTERPRET:
        check_pools_sharing_x("cpu", ("q", "k", "v"))


def test_prefill_and_fused_launches_keep_their_kernels(decode):
    """Only captured decode metadata (16-row tiles) takes the decode kernels; the one-launch kernel, when
    asked for, wins."""
    prefill = LoRABatchMeta(64, "cpu", tile_m=64, capture=True, max_rank=16)
    assert not pick_config(prefill, 64, (32,), torch.float32).decode
    eager = LoRABatchMeta(64, "cpu", tile_m=16, capture=False, max_rank=16)
    assert not pick_config(eager, 64, (32,), torch.float32).decode
    set_capture_policy(**{**dataclasses.asdict(capture_policy()), "fused": True})
    captured = LoRABatchMeta(64, "cpu", tile_m=16, capture=True, max_rank=16)
    cfg = pick_config(captured, 64, (32,), torch.float32)
    assert cfg.one_launch and not cfg.decode


@pytest.mark.gpu
@pytest.mark.parametrize("dot", [True, False], ids=["dot", "vector"])
@pytest.mark.parametrize("module", ["qkv", "gate_up", "down"])
def test_gpu_graph_replays_new_batches(module, dot):
    """Full-size blocks (the policy's defaults): one graph of several layers' launches, replayed for
    batches of distinct adapters, of shared ones and of a mix; each replay matches its reference."""
    fields = {"decode": True, "fused": False, "decode_dot": dot}
    old = set_capture_policy(**{**dataclasses.asdict(capture_policy()), **fields})
    try:
        replay_checked(module, 4, ((57, 1), (64, 16), (9, 3)))
    finally:
        set_capture_policy(**dataclasses.asdict(old))


@pytest.mark.gpu
@pytest.mark.parametrize("dot", [True, False], ids=["dot", "vector"])
@pytest.mark.parametrize("module", ["qkv", "gate_up", "down"])
def test_gpu_pdl_launches_wait_for_the_kernels_ahead(module, dot):
    """Programmatic dependent launch (Hopper): in the graph, x and y are written by the kernels just ahead
    of each shrink and expand, over NaN; every replay matches its reference, and the launches were
    compiled to wait (GDC) where the device has it."""
    fields = {"decode": True, "fused": False, "decode_dot": dot, "pdl": True}
    old = set_capture_policy(**{**dataclasses.asdict(capture_policy()), **fields})
    try:
        case = replay_checked(module, 4, ((57, 1), (64, 16), (9, 3)), produced=True)
    finally:
        set_capture_policy(**dataclasses.asdict(old))
    if pdl_available(case.x):  # the launches recorded for this device were compiled to wait
        compiled = [dict(key[1])["GDC"] for key in fast_launch._RECORDED if key[0] is _shrink_decode_kernel]
        assert True in compiled


def test_captured_decode_takes_the_decode_kernels_by_default_no_wider_than_a_slice():
    """The default policy: captured decode launches take the decode kernels, 1024 output columns a program
    where the widest slice has as many, and no more than the widest slice otherwise."""
    assert capture_policy() == CapturePolicy()
    captured = LoRABatchMeta(64, "cpu", tile_m=16, capture=True, max_rank=16)
    wide = pick_config(captured, 4096, (14336, 14336), torch.bfloat16)
    assert wide.decode and wide.block_n == wide.n_chunk == CapturePolicy().decode_n == 1024
    narrow = pick_config(captured, 64, (48, 16), torch.float32)
    assert narrow.decode and narrow.block_n == 64


@pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("per_req", [1, 3])
def test_default_blocks_on_a_ragged_wide_slice(per_req):
    """The default policy's blocks (512 inputs, 1024 outputs a program) over a slice of 2,049 columns that
    starts at column 5: two full column blocks and a masked one, inputs fewer than one block."""
    assert capture_policy() == CapturePolicy()
    spec = ModuleSpec(40, (2049,), slice_starts=(5,), y_width=2059)
    bank = Bank(spec, (1, 8, 37, 64) * (3 if per_req == 1 else 1), torch.float32)
    b = bank.batch(bank.requests(12, per_req), capacity=16, capture=True)
    assert pick_config(b.meta, 40, (2049,), torch.float32).block_n == 1024
    y = b.y0.clone()
    lora_apply(y, b.x, bank.pool, 0, "m", b.meta, backend="triton")
    check(bank, b, y)
