"""Shrink + expand with any in_dim, any slice width and any slice start, every rank class in one launch.

CPU: the Triton kernels in the interpreter (fp32, fp16). GPU (``gpu``): bf16 and fp16, 128-token
segments, and decode metadata behind a captured CUDA graph replayed with a new batch. What may change
and what must not is checked by ``width_case.check`` (poisoned pool rows, x rows and y columns).
"""

from __future__ import annotations

import os

import pytest
import torch

from loraplane.kernels import ModuleSpec, lora_apply
from loraplane.kernels.triton_ops import LaunchConfig, pick_config
from tests.kernels.width_case import Bank, check

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")

# Powers of two 1..128 and odd ranks, all active in the same batch.
RANKS = (1, 2, 4, 8, 16, 32, 64, 128, 3, 37, 127)
WIDTHS = (1, 2, 8, 15, 17, 107, 216, 2049)
GPU_WIDTHS = (*WIDTHS, 2004, 3784)
IN_DIMS = (13, 64, 107, 33)  # ragged and aligned K, cycled over the widths


def one_slice(width: int, start: int) -> ModuleSpec:
    """A single slice at column ``start`` of a y with a few columns past its end."""
    in_dim = IN_DIMS[WIDTHS.index(width) % len(IN_DIMS)] if width in WIDTHS else 4096
    return ModuleSpec(in_dim, (width,), slice_starts=(start,), y_width=start + width + 5)


# Several slices: out of order with gaps, a ragged packed qkv, and aligned next to ragged.
MULTI = {
    "gaps-out-of-order": ModuleSpec(33, (15, 17, 2), slice_starts=(3, 40, 19), y_width=60),
    "packed-ragged-qkv": ModuleSpec(107, (107, 27, 27)),
    "aligned+ragged": ModuleSpec(64, (64, 15), slice_starts=(3, 70)),
}


def _apply(bank: Bank, b, config=None, backend="triton") -> torch.Tensor:
    y = b.y0.clone()
    lora_apply(y, b.x, bank.pool, 0, "m", b.meta, backend=backend, config=config)
    return y


@needs_interpreter
@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("width", WIDTHS)
def test_one_slice_any_width_and_start(width, start):
    """Every rank class of RANKS in one launch; fp32 and fp16 alternate over the widths."""
    dtype = (torch.float32, torch.float16)[(WIDTHS.index(width) + start) % 2]
    bank = Bank(one_slice(width, start), RANKS, dtype)
    b = bank.batch(bank.requests(16, 1))
    check(bank, b, _apply(bank, b))


@needs_interpreter
@pytest.mark.parametrize("name", list(MULTI))
def test_several_slices_any_place(name):
    bank = Bank(MULTI[name], RANKS[::2], torch.float32)
    b = bank.batch(bank.requests(12, 2), tile_m=16)
    check(bank, b, _apply(bank, b))


@needs_interpreter
def test_torch_reference_places_slices():
    """The CPU engine path (plain torch) obeys the same placement, bit-identical elsewhere."""
    bank = Bank(MULTI["gaps-out-of-order"], RANKS, torch.float32)
    b = bank.batch(bank.requests(20, 3))
    check(bank, b, _apply(bank, b, backend="torch"))


@needs_interpreter
@pytest.mark.parametrize(
    "cfg",
    [
        LaunchConfig(block_r=16, block_k=16, block_n=16, n_chunk=32, split_k=4, shrink_programs=3, expand_programs=5),
        LaunchConfig(block_r=64, shrink_block_r=32, block_k=32, block_n=16, n_chunk=16, fused=True),
    ],
    ids=["split4-strided-chunk32", "fused"],
)  # fmt: skip
def test_ragged_launch_configs(cfg):
    """Split-K planes, grid-stride tile loops, chunks that straddle no slice, and the fused expand."""
    bank = Bank(MULTI["gaps-out-of-order"], RANKS[::3], torch.float32)
    b = bank.batch(bank.requests(10, 2))
    check(bank, b, _apply(bank, b, config=cfg))


@needs_interpreter
def test_captured_meta_ragged_rows_past_the_batch_untouched():
    bank = Bank(one_slice(17, 3), (8, 5, 64), torch.float32)
    b = bank.batch(bank.requests(9, 1), capacity=16, capture=True)
    check(bank, b, _apply(bank, b))


@needs_interpreter
def test_rank_256_pool():
    """A pool built for rank 256 (rank loops of four 64-row chunks), ragged width and start."""
    bank = Bank(one_slice(15, 3), (256, 200, 1), torch.float32, max_rank=256)
    b = bank.batch(bank.requests(6, 2))
    check(bank, b, _apply(bank, b))


def test_ragged_config_masks_instead_of_padding():
    """Ragged widths keep tl.dot's 16-column minimum by masking, never by demanding aligned slices."""
    bank = Bank(MULTI["gaps-out-of-order"], (8,), torch.float32)
    b = bank.batch(bank.requests(4, 1))
    cfg = pick_config(b.meta, 33, (15, 17, 2), torch.float32)
    assert cfg.block_n >= 16 and cfg.n_chunk >= cfg.block_n
    aligned = pick_config(b.meta, 4096, (4096, 1024, 1024), torch.float32)
    assert aligned.block_n == 64 and 1024 % aligned.n_chunk == 0


# -- GPU -------------------------------------------------------------------------------------------------
GPU_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
GPU_SPECS = {f"w{w}-s{s}": one_slice(w, s) for w in GPU_WIDTHS for s in (0, 3)} | MULTI


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("name", list(GPU_SPECS))
def test_gpu_prefill_segments(name, dtype):
    """128-token segments of every rank class (tile_m 64), some segments without an adapter."""
    bank = Bank(GPU_SPECS[name], RANKS, dtype, "cuda")
    b = bank.batch(bank.requests(128 * 12, 128), tile_m=64)
    y = _apply(bank, b, backend="auto")
    torch.cuda.synchronize()
    check(bank, b, y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("name", list(GPU_SPECS))
def test_gpu_decode_graph_replayed_with_a_new_batch(name, dtype):
    """Decode metadata (capture on): capture one lora_apply, then rebuild the metadata and inputs in
    place for another batch and replay; the replay must match that batch's reference."""
    bank = Bank(GPU_SPECS[name], RANKS, dtype, "cuda")
    first = bank.batch(bank.requests(40, 1), capacity=64, capture=True)
    x, y = first.x.clone(), first.y0.clone()
    _apply_into(bank, first.meta, x, y)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _apply_into(bank, first.meta, x, y)
    second = bank.batch(bank.requests(57, 1), meta=first.meta)
    x.copy_(second.x)
    y.copy_(second.y0)
    graph.replay()
    torch.cuda.synchronize()
    check(bank, second, y)


def _apply_into(bank, meta, x, y):
    lora_apply(y, x, bank.pool, 0, "m", meta)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("max_rank", [256, 512])
def test_gpu_high_rank_pools(max_rank, dtype):
    """Pools built for rank 256 and for the limit, 512, on Llama-like and ragged shapes."""
    for spec in (ModuleSpec(4096, (4096, 1024, 1024)), one_slice(2004, 3)):
        bank = Bank(spec, (max_rank, max_rank // 2 + 3, 16), dtype, "cuda", max_rank=max_rank)
        for b in (
            bank.batch(bank.requests(384, 128), tile_m=64),
            bank.batch(bank.requests(24, 1), capacity=32, capture=True),
        ):
            y = _apply(bank, b, backend="auto")
            torch.cuda.synchronize()
            check(bank, b, y)
