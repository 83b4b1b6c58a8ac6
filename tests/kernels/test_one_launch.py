"""The one-launch decode kernel (triton_fused; ``CapturePolicy(fused=True)``): the same result as the
plain-torch reference for packed modules, pools sharing one input, any width and slice start, mixed
ranks and base-only rows; on the GPU, inside CUDA graphs replayed with new batches, layer after layer.

On CPU the interpreter runs the kernel's two phases as two launches; the GPU tests run the real thing
(one launch, groups of programs waiting on each other's split-K planes).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from loraplane.kernels import lora_apply
from loraplane.kernels.launch_config import capture_policy, pick_config, set_capture_policy
from loraplane.kernels.triton_fused import FUSED_SYNC
from tests.kernels.graph_replay import replay_checked
from tests.kernels.lora_case import make_case
from tests.kernels.test_many import check_pools_sharing_x
from tests.kernels.test_ops import MIXED, _check, _run
from tests.kernels.width_case import Bank, check

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.fixture
def one_launch():
    """Captured launches take the one-launch kernel for the test's duration."""
    old = set_capture_policy(**{**dataclasses.asdict(capture_policy()), "fused": True})
    try:
        yield
    finally:
        set_capture_policy(**dataclasses.asdict(old))


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("module", ["q", "qkv", "gate_up", "down"])
def test_packed_modules_mixed_ranks_and_base_rows(one_launch, device, module):
    """Ranks 8-128 and 12 in one batch, a fifth of the rows base-only (NaN there must stay NaN), rows
    past the batch untouched; every packed slice lands at its columns."""
    case = make_case(num_tokens=24, num_adapters=10, ranks=MIXED, module=module, capture=True, capacity=32,
                     dtype=_dtype(device), device=device)  # fmt: skip
    spec = case.pool.modules[module]
    assert pick_config(case.meta, spec.in_dim, spec.out_dims, case.x.dtype).one_launch
    _check(case, _run(case, "triton"), _dtype(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("names", [("q", "k", "v"), ("gate", "up"), ("k", "q")], ids=["qkv", "gate_up", "kq"])
def test_pools_sharing_x(one_launch, device, names):
    """q, k, v (gate, up) from pools of their own, one launch; an adapter without a module has rank 0
    in that pool; a gap between slices stays as it was."""
    meta = check_pools_sharing_x(device, names)
    assert all(p.one is not None for k, p in meta.plans.items() if k[0] == "pools")


@pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("width,start", [(17, 3), (107, 0), (2049, 5)])
def test_any_width_and_start(one_launch, width, start):
    from loraplane.kernels import ModuleSpec

    spec = ModuleSpec(40, (width,), slice_starts=(start,), y_width=start + width + 5)
    bank = Bank(spec, (1, 8, 37, 64), torch.float32)
    b = bank.batch(bank.requests(12, 1), capacity=16, capture=True)
    y = b.y0.clone()
    lora_apply(y, b.x, bank.pool, 0, "m", b.meta, backend="triton")
    check(bank, b, y)


@pytest.mark.gpu
@pytest.mark.parametrize("module", ["qkv", "gate_up", "down"])
def test_gpu_graph_replays_layer_after_layer(one_launch, module):
    """One graph of 6 launches on the same counters (as a step's layers), replayed for three batches:
    each replay matches its reference, and the counters end at multiples of the per-launch amount."""
    first = replay_checked(module, 6, ((57, 1), (64, 1), (9, 1)))
    sync = first.meta.sync.cpu()
    assert (sync % FUSED_SYNC == 0).all() and sync.any()
