"""The shrink beside the base GEMM (``lora_apply(..., base=)``, kernels/overlap.py): the callable that writes
y's base values runs once, before the expand, on every path; under a captured launch the shrink runs on a
side stream in parallel with it, and a captured graph gives bit for bit what one stream gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplane.kernels import LoRABatchMeta, lora_apply, lora_apply_many, overlap, triton_apply
from loraplane.kernels.launch_config import capture_policy, set_capture_policy
from tests.kernels.test_many import DEVICES, IN, TERMS, WIDTHS, _pools, _reference, _targets
from tests.numerics import assert_close_sums

REQUESTS = {
    "decode": ([(0, 1), (1, 1), (-1, 1), (2, 1), (1, 1), (0, 1)], 16, False),
    "captured": ([(2, 1), (0, 1), (1, 1), (-1, 1)], 16, True),
    "prefill": ([(1, 37), (-1, 5), (0, 70), (2, 9)], 64, False),
}


class Gemm:
    """y = x @ W^T into a given y, counting its calls."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.w, self.y, self.calls = x, w, y, 0

    def __call__(self) -> None:
        self.calls += 1
        torch.mm(self.x, self.w.t(), out=self.y)


NAMES = pytest.mark.parametrize(
    "names", [("q", "k", "v"), ("q",), ("k", "q")], ids=["pooled", "single", "two_applies"]
)


@pytest.mark.parametrize("device", DEVICES)
@NAMES
@pytest.mark.parametrize("kind", list(REQUESTS))
def test_base_runs_once_before_the_expand(device, names, kind):
    _check_base_once(device, names, kind)


@pytest.mark.gpu
@NAMES
@pytest.mark.parametrize("pdl", [False, True])
def test_expand_beside_adds_the_delta_after_the_base(names, pdl, monkeypatch):
    """``expand_beside``: the expand into a zeroed delta on the side stream, added to the GEMM's output
    after the join; rows without an adapter keep the GEMM's values, a view's columns only are touched.
    The pair goes beside exactly when x's width times the launch's columns reaches the threshold."""
    calls = []

    def counted(*args):
        calls.append(1)
        return overlap.lora_beside(*args)

    monkeypatch.setattr(triton_apply, "lora_beside", counted)
    old = capture_policy()
    widest = IN * (sum(WIDTHS[n] for n in names) + 8 * len(names))  # no launch covers more (gaps included)
    try:
        for threshold in (1, widest + 1):
            calls.clear()
            set_capture_policy(**{**dataclasses.asdict(old), "expand_beside": threshold, "pdl": pdl})
            _check_base_once("cuda", names, "captured")
            assert bool(calls) == (threshold == 1)  # above every launch's size: the shrink-beside form
    finally:
        set_capture_policy(**dataclasses.asdict(old))


def _check_base_once(device, names, kind) -> None:
    pools, ranks = _pools(device)
    reqs, tile_m, capture = REQUESTS[kind]
    tokens = sum(n for _, n in reqs)
    meta = LoRABatchMeta(tokens + 3, device, tile_m=tile_m, capture=capture, max_rank=16).build(reqs, ranks)
    gap = 8 if names == ("k", "q") else 0  # columns between the slices
    targets, width = _targets(pools, names, gap)
    g = torch.Generator().manual_seed(3)
    for layer in range(2):  # the second layer replays the first one's plans
        rows = tokens + 3 if capture else tokens
        x = torch.randn(rows, IN, generator=g).to(device)
        w = torch.randn(width, IN, generator=g).to(device)
        want = _reference(x @ w.t(), x, targets, layer, meta)
        y = torch.full((rows, width), float("nan"), device=device)  # the GEMM must write every value
        gemm = Gemm(x, w, y)
        if len(names) == 1:
            ((pool, m, _),) = targets
            got = lora_apply(y, x, pool, layer, m, meta, backend="triton", base=gemm)
        else:
            got = lora_apply_many(y, x, targets, layer, meta, backend="triton", base=gemm)
        assert gemm.calls == 1
        assert got is y
        assert_close_sums(got, want, TERMS)


def test_torch_path_runs_base_first():
    pools, ranks = _pools("cpu")
    meta = LoRABatchMeta(8).build([(0, 2), (1, 3)], ranks)
    targets, width = _targets(pools, ("q", "k", "v"))
    x, w = torch.randn(5, IN), torch.randn(width, IN)
    y = torch.full((5, width), float("nan"))
    gemm = Gemm(x, w, y)
    got = lora_apply_many(y, x, targets, 1, meta, backend="torch", base=gemm)
    assert gemm.calls == 1
    assert_close_sums(got, _reference(x @ w.t(), x, targets, 1, meta), TERMS)


def test_no_token_with_an_adapter_still_runs_base():
    pools, ranks = _pools("cpu")
    meta = LoRABatchMeta(8).build([(-1, 4)], ranks)
    ((pool, m, _),) = _targets(pools, ("q",))[0]
    x, w = torch.randn(4, IN), torch.randn(WIDTHS["q"], IN)
    y = torch.full((4, WIDTHS["q"]), float("nan"))
    gemm = Gemm(x, w, y)
    lora_apply(y, x, pool, 0, m, meta, backend="torch", base=gemm)
    assert gemm.calls == 1 and torch.equal(y, x @ w.t())


def _graph_layers(pools, meta, targets, xs, ws, ys) -> torch.cuda.CUDAGraph:
    """Three layers, each a GEMM into its y and the LoRA of its targets, captured into one graph."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer, (x, w, y) in enumerate(zip(xs, ws, ys, strict=True)):
            lora_apply_many(y, x, targets, layer % 2, meta, base=Gemm(x, w, y))
    return graph


@pytest.mark.gpu
@pytest.mark.parametrize("names", [("q", "k", "v"), ("gate", "up")])
def test_captured_overlap_equals_one_stream_bit_for_bit(names):
    """The same three layers captured with the shrink beside the GEMM and without: identical outputs on
    every replay (the same kernels on the same inputs; only their streams differ), and the eager reference.
    With the expand beside as well (the delta rounded before it is added): the reference's band."""
    device = "cuda"
    pools, ranks = _pools(device, dtype=torch.bfloat16)
    targets, width = _targets(pools, names)
    reqs = [(2, 1), (0, 1), (1, 1), (-1, 1), (0, 1)]
    outputs = {}
    old = capture_policy()
    try:
        for overlap in (False, True, "expand_beside"):
            fields = {"overlap": bool(overlap), "expand_beside": int(overlap == "expand_beside")}
            set_capture_policy(**{**dataclasses.asdict(old), **fields})
            meta = LoRABatchMeta(16, device, capture=True, max_rank=16).build(reqs, ranks)
            g = torch.Generator(device=device).manual_seed(5)
            xs = [torch.randn(16, IN, device=device, generator=g, dtype=torch.bfloat16) for _ in range(3)]
            ws = [torch.randn(width, IN, device=device, generator=g, dtype=torch.bfloat16) for _ in range(3)]
            ys = [torch.empty(16, width, device=device, dtype=torch.bfloat16) for _ in range(3)]
            for x, w, y in zip(xs, ws, ys, strict=True):  # compile outside the capture
                lora_apply_many(y, x, targets, 0, meta, base=Gemm(x, w, y))
            graph = _graph_layers(pools, meta, targets, xs, ws, ys)
            runs = []
            for seed in (7, 8):
                gx = torch.Generator(device=device).manual_seed(seed)
                for x in xs:
                    x.copy_(torch.randn(x.shape, device=device, generator=gx, dtype=torch.bfloat16))
                graph.replay()
                torch.cuda.synchronize()
                runs.append([y.clone() for y in ys])
                for layer, (x, w, y) in enumerate(zip(xs, ws, ys, strict=True)):
                    want = _reference(x @ w.t(), x, targets, layer % 2, meta)
                    err = torch.linalg.norm(y.float() - want.float()) / torch.linalg.norm(want.float())
                    assert err < 1.5e-2  # bf16: the band of the kernels' GPU tests
            outputs[overlap] = runs
    finally:
        set_capture_policy(**dataclasses.asdict(old))
    for a, b in zip(outputs[False], outputs[True], strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
