"""bench/kernels/ab.py's baseline side: an older kernels package runs wholly on its own modules, on a pool
that mirrors this tree's adapters page for page, so a before/after compares kernels and nothing else."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest
import torch

from loraplane.kernels import LoRABatchMeta, LoRAPool, ModuleSpec, lora_apply

ROOT = pathlib.Path(__file__).resolve().parents[2]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _ab():
    spec = importlib.util.spec_from_file_location("kernels_ab", ROOT / "bench/kernels/ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def ab():
    yield _ab()
    for name in [n for n in sys.modules if n == "kernels_baseline" or n.startswith("kernels_baseline.")]:
        del sys.modules[name]


def _pool() -> tuple[LoRAPool, list[int]]:
    spec = {"m": ModuleSpec(40, (24, 8, 8))}
    pool = LoRAPool(spec, 1, 16 * LoRAPool.page_bytes_for(spec, 1, 4, torch.float32), page_rank=4,
                    max_rank=16, max_adapters=8, dtype=torch.float32, device="cpu")  # fmt: skip
    slots = [pool.allocate(r, 2.0 / r**0.5) for r in (4, 12, 8)]
    g = torch.Generator().manual_seed(3)
    pool.a[(0, "m")].copy_(torch.randn(pool.a[(0, "m")].shape, generator=g))
    pool.bt[(0, "m")].copy_(torch.randn(pool.bt[(0, "m")].shape, generator=g))
    return pool, slots


def test_the_baseline_imports_only_its_own_modules(ab):
    old = ab.load_baseline(str(ROOT / "src/loraplane/kernels"))
    folder = pathlib.Path(old.__file__).parent
    assert folder != ROOT / "src/loraplane/kernels"
    assert old.LoRAPool is not LoRAPool and old.LoRAPool.__module__.startswith("kernels_baseline")
    loaded = [m for n, m in sys.modules.items() if n.startswith("kernels_baseline.")]
    assert loaded and all(pathlib.Path(m.__file__).parent == folder for m in loaded)
    assert all(b"loraplane.kernels" not in f.read_bytes() for f in folder.glob("*.py"))


def test_a_folder_without_the_package_is_refused(ab, tmp_path):
    (tmp_path / "triton_ops.py").write_text("")
    with pytest.raises(SystemExit, match="no src/loraplane/kernels/ package"):
        ab.load_baseline(str(tmp_path))


@pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("T,reqs", [(5, [(0, 1), (1, 1), (2, 1), (1, 1), (0, 1)]), (12, [(2, 7), (0, 5)])])
def test_the_mirrored_pool_gives_the_same_delta(ab, T, reqs):
    """Same adapters, same page rows, same weights: the baseline (here this tree's own kernels) adds the
    same delta as this tree, decode-shaped (one token a request) and prefill-shaped."""
    pool, slots = _pool()
    old = ab.load_baseline(str(ROOT / "src/loraplane/kernels"))
    twin = ab.mirror_pool(old, pool)
    requests = [(slots[a], c) for a, c in reqs]
    capture = len(requests) == T  # one token a request: decode
    meta = ab._build_meta(LoRABatchMeta, pool, requests, T, capture)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(T, 40, generator=g), torch.randn(T, 40, generator=g)
    before, after = y.clone(), y.clone()
    ab._old_fn(old, twin, requests, T, capture, x, before)()
    lora_apply(after, x, pool, 0, "m", meta)
    assert not torch.equal(after, y)  # the case adds a delta at all
    torch.testing.assert_close(before, after, rtol=1e-5, atol=1e-5)


def test_a_baseline_pool_that_places_pages_elsewhere_is_refused(ab):
    pool, _ = _pool()
    old = ab.load_baseline(str(ROOT / "src/loraplane/kernels"))
    original = old.LoRAPool.allocate

    def allocate_after_a_hole(self, rank, scale, slot=None, **kw):
        if not getattr(self, "_hole", False):
            self._hole = True
            original(self, 4, 1.0, 7)  # takes the first page, so every later slot lands one page on
        return original(self, rank, scale, slot, **kw)

    old.LoRAPool.allocate = allocate_after_a_hole
    with pytest.raises(AssertionError, match="other page rows"):
        ab.mirror_pool(old, pool)
