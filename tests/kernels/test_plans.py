"""Launch shapes kept per step (``meta.plans``) and direct re-launches (``FastLaunch``).

Every layer after the first of a step reuses the first layer's launch shapes with its own tensors: the
result must be what a fresh launch computes, for every layer, and a new step's build drops the shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

from loraplane.kernels import LoRABatchMeta, LoRAPool, ModuleSpec, lora_apply
from tests.numerics import assert_close_sums

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
SPECS = {"q": ModuleSpec(48, (32,)), "kv": ModuleSpec(48, (16, 16))}
TERMS = 48 + 16  # x @ A^T over in_dim, then @ B^T over the rank (16 at most)


def _pool(device: str, layers: int = 3) -> tuple[LoRAPool, list[int]]:
    g = torch.Generator().manual_seed(7)
    pool = LoRAPool(SPECS, layers, 8 << 20, page_rank=1, max_rank=16, dtype=torch.float32, device=device)
    slots = []
    for rank in (8, 16, 4):
        slot = pool.allocate(rank, 0.5)
        for layer in range(layers):
            for name, spec in SPECS.items():
                for s, w in enumerate(spec.out_dims):
                    a = torch.randn(rank, spec.in_dim, generator=g)
                    pool.write(slot, layer, name, s, a, torch.randn(w, rank, generator=g))
        slots.append(slot)
    return pool, slots


def _apply(pool, meta, layer, module, x, backend):
    y = torch.zeros(x.shape[0], pool.modules[module].y_width, device=x.device)
    return lora_apply(y, x, pool, layer, module, meta, backend=backend)


@pytest.mark.parametrize("device", DEVICES)
def test_every_layer_reuses_the_first_layers_launch_shapes(device):
    pool, slots = _pool(device)
    meta = LoRABatchMeta(24, device)
    meta.build([(slots[0], 5), (-1, 3), (slots[1], 9), (slots[2], 4)], pool.host_ranks())
    xs = [torch.randn(21, 48, device=device) for _ in range(pool.num_layers)]
    for layer, x in enumerate(xs):
        for module in SPECS:
            got = _apply(pool, meta, layer, module, x, "triton")
            want = _apply(pool, meta, layer, module, x, "torch")
            assert_close_sums(got, want, TERMS)
    assert len(meta.plans) == len(SPECS)  # one per module, shared by the layers
    meta.build([(slots[1], 2)], pool.host_ranks())
    assert meta.plans == {}
    got = _apply(pool, meta, 1, "q", xs[1][:2], "triton")
    assert_close_sums(got, _apply(pool, meta, 1, "q", xs[1][:2], "torch"), TERMS)


@pytest.mark.parametrize("device", DEVICES)
def test_shrink_buffers_outlive_the_steps_plans(device):
    """A graph captured over a step keeps the shrink output's address after the next build drops that
    step's plans: the buffer must stay owned (by the metadata), never freed for reuse under the graph."""
    import gc
    import weakref

    pool, slots = _pool(device, layers=1)
    meta = LoRABatchMeta(16, device, capture=True).build([(slots[0], 3), (slots[1], 5)], pool.host_ranks())
    _apply(pool, meta, 0, "kv", torch.randn(8, 48, device=device), "triton")
    (plan,) = meta.plans.values()
    v = weakref.ref(plan.v)
    meta.build([(slots[2], 2)], pool.host_ranks())
    del plan
    gc.collect()
    assert meta.plans == {} and v() is not None
    x = torch.randn(2, 48, device=device)
    got = _apply(pool, meta, 0, "kv", x, "triton")
    assert_close_sums(got, _apply(pool, meta, 0, "kv", x, "torch"), TERMS)


@pytest.mark.parametrize("device", DEVICES)
def test_a_misaligned_input_falls_back_to_a_fresh_launch(device):
    pool, slots = _pool(device, layers=1)
    meta = LoRABatchMeta(8, device).build([(slots[0], 4), (slots[2], 4)], pool.host_ranks())
    wide = torch.randn(8, 49, device=device)
    aligned = wide[:, :48].contiguous()
    shifted = wide[:, 1:]  # the same plan as wide[:, :48] (same shape, strides), but 4 bytes off 16
    for x in (aligned, wide[:, :48], shifted, aligned):
        got = _apply(pool, meta, 0, "q", x, "triton")
        want = _apply(pool, meta, 0, "q", x.contiguous(), "torch")
        assert_close_sums(got, want, TERMS)


@pytest.mark.gpu
def test_fast_launch_is_taken_on_the_gpu():
    """After a step's first layer, both launches skip Triton's binding (the point of the plans)."""
    pool, slots = _pool("cuda")
    meta = LoRABatchMeta(16, "cuda").build([(slots[0], 6), (slots[1], 6)], pool.host_ranks())
    x = torch.randn(12, 48, device="cuda")
    for layer in range(pool.num_layers):
        _apply(pool, meta, layer, "kv", x, "auto")
    (plan,) = meta.plans.values()
    assert plan.shrink._run is not None and plan.expand._run is not None


class _FakeKernel:
    """A compiled kernel as Triton 3.x keeps it: the launcher behind a ``run`` property over ``_run``."""

    def __init__(self):
        self._run = None
        self.function, self.packed_metadata = 0x5EED, ("meta",)
        self.calls: list[tuple] = []

    @property
    def run(self):
        if self._run is None:
            self._run = self._launch
        return self._run

    def _launch(self, *call):
        self.calls.append(call)


class _FakeJit:
    """``fn[grid](*args, **constexprs)`` as Triton calls the launcher: grid, stream, function, metadata,
    launch metadata, the two hook chains, then every parameter (run-time ones, then constexprs)."""

    def __init__(self, hooks=None):
        from triton.knobs import HookChain

        self.kernel, self.bindings = _FakeKernel(), 0
        self.hooks = hooks or (HookChain(), HookChain(reversed=True))

    def warmup(self, *args, grid, **kw):
        self.bindings += 1
        return self.kernel

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.bindings += 1
            k = self.kernel
            consts = [v for name, v in kw.items() if name.isupper()]
            k.run(
                grid[0],
                grid[1],
                1,
                "stream",
                k.function,
                k.packed_metadata,
                {"lazy": 1},
                *self.hooks,
                *args,
                *consts,
            )
            return k

        return launch


def _fast(monkeypatch, fn):
    from loraplane.kernels import fast_launch

    monkeypatch.setattr(fast_launch, "_on_gpu", lambda args: True)
    monkeypatch.setattr(fast_launch, "_current_stream", lambda device: "stream")
    return fast_launch.FastLaunch(fn, (3, 2), {"BLOCK": 16, "MODE": "x"}, num_warps=4)


def test_fast_launch_replays_what_triton_passed_and_falls_back_when_specialization_differs(monkeypatch):
    fn = _FakeJit()
    launch = _fast(monkeypatch, fn)
    buf = torch.zeros(64)
    x, t = buf[:16], torch.zeros(4, dtype=torch.int32)
    launch(x, 4096, t)  # through Triton, recorded
    assert fn.bindings == 2 and len(fn.kernel.calls) == 1
    y = buf[16:32]  # same dtype, 64 bytes on: still 16-byte aligned
    launch(y, 8192, t)  # direct: no binding
    assert fn.bindings == 2
    assert fn.kernel.calls[-1] == (
        3,
        2,
        1,
        "stream",
        0x5EED,
        ("meta",),
        None,
        None,
        None,
        y,
        8192,
        t,
        16,
        "x",
    )
    launch(buf[1:17], 4096, t)  # 4 bytes off 16-byte alignment: Triton specializes differently
    launch(x, 4097, t)  # an int that is no longer a multiple of 16
    launch(x, 1, t)  # an int equal to 1
    assert fn.bindings == 5 and len(fn.kernel.calls) == 5
    launch(torch.zeros(16, dtype=torch.float16), 4096, t)  # another dtype
    assert fn.bindings == 6
    launch(y, 4096, t)
    launch(y, 4096, t.long())  # the int32 table as int64
    assert fn.bindings == 7 and len(fn.kernel.calls) == 8


def test_fast_launch_tells_a_bool_from_the_int_it_equals(monkeypatch):
    """True == 1 in Python, but Triton types a bool argument apart from an int: a launch recorded with one
    must not replay for the other."""
    fn = _FakeJit()
    launch = _fast(monkeypatch, fn)
    x = torch.zeros(16)
    launch(x, True, x)  # through Triton, recorded
    launch(x, True, x)  # direct
    assert fn.bindings == 2 and len(fn.kernel.calls) == 2
    launch(x, 1, x)  # another specialization: Triton's path
    assert fn.bindings == 3 and len(fn.kernel.calls) == 3


def test_fast_launch_stays_on_tritons_path_when_the_call_does_not_fit(monkeypatch):
    from triton.knobs import HookChain

    busy = HookChain()
    busy.add(lambda md: None)  # a profiler's hook: the fast path would skip it
    fn = _FakeJit(hooks=(busy, HookChain()))
    launch = _fast(monkeypatch, fn)
    x = torch.zeros(16)
    for _ in range(3):
        launch(x, 16, x)
    assert fn.bindings == 1 + 3  # one recording attempt, then Triton's own path (no second binding)
    assert len(fn.kernel.calls) == 3


def test_a_later_step_reuses_the_recorded_launcher(monkeypatch):
    """Plans are rebuilt each step; the new FastLaunch of the same kernel and shape launches directly."""
    from loraplane.kernels import fast_launch

    fn = _FakeJit()
    x = torch.zeros(16)
    before = fast_launch.launch_counts()
    _fast(monkeypatch, fn)(x, 32, x)
    assert fn.bindings == 2
    again = fast_launch.FastLaunch(fn, (3, 2), {"BLOCK": 16, "MODE": "x"}, num_warps=4)
    again(x, 48, x)
    assert fn.bindings == 2 and len(fn.kernel.calls) == 2
    other = fast_launch.FastLaunch(fn, (3, 2), {"BLOCK": 32, "MODE": "x"}, num_warps=4)
    other(x, 48, x)  # other compile-time values: another kernel, through Triton
    assert fn.bindings == 4
    after = fast_launch.launch_counts()  # what benchmarks report per window
    assert (after["triton"] - before["triton"], after["direct"] - before["direct"]) == (2, 1)


def test_compile_only_lists_each_shape_once_and_launches_nothing(monkeypatch):
    """Inside ``compile_only`` a launch only lists its shape (once per shape); ``compile_queued`` then
    compiles each (Triton's ``warmup``) on a pool of threads; afterwards the same launch runs and is
    recorded as usual."""
    from loraplane.kernels import fast_launch

    fn = _FakeJit()
    x = torch.zeros(16)
    with fast_launch.compile_only() as queued:
        _fast(monkeypatch, fn)(x, 64, x)
        fast_launch.FastLaunch(fn, (3, 2), {"BLOCK": 16, "MODE": "x"}, num_warps=4)(x, 32, x)  # same shape
        fast_launch.FastLaunch(fn, (3, 2), {"BLOCK": 32, "MODE": "x"}, num_warps=4)(x, 64, x)
        fast_launch.FastLaunch(fn, (3, 2), {"BLOCK": 16, "MODE": "x"}, num_warps=4)(x, 65, x)  # not % 16
    assert len(queued) == 3 and fn.bindings == 0 and fn.kernel.calls == []
    for _, args in queued.values():  # small stand-ins, not the step's tensors
        assert (
            args[0] is not x
            and args[0].dtype == x.dtype
            and args[0].data_ptr() % 16 == 0
            and args[1] in (64, 65)
        )
    with fast_launch.compile_only() as off:
        fast_launch.FastLaunch(fn, (3, 2), {"BLOCK": 8}, num_warps=4)(torch.zeros(9)[1:], 64, x)
    ((_, args),) = off.values()
    assert args[0].dtype == torch.float32 and args[0].data_ptr() % 16 != 0  # misaligned as the real one
    assert fast_launch.compile_queued(queued, threads=2) == 3
    assert fn.bindings == 3 and fn.kernel.calls == []
    launch = fast_launch.FastLaunch(fn, (3, 2), {"BLOCK": 16, "MODE": "y"}, num_warps=4)
    launch(x, 64, x)
    assert len(fn.kernel.calls) == 1 and launch._run is not None
