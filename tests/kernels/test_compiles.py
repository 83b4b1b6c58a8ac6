"""The compile counter that benchmarks report and the warm-up test relies on must see loraplane's kernels.
(The suite runs Triton's interpreter, whose ``triton.jit`` makes no JIT function, so these build one.)"""

from __future__ import annotations

import sys
import types

import pytest

triton = pytest.importorskip("triton")

from triton.runtime.jit import JITFunction  # noqa: E402

from loraplane.kernels.compiles import jit_function, triton_compiled  # noqa: E402


def _kernel_source(x_ptr):  # the Python function behind the JIT function below
    pass


def test_jit_function_finds_the_kernel_through_its_wrappers():
    kernel = JITFunction(_kernel_source)
    assert jit_function(kernel, JITFunction) is kernel  # not its Python source function (kernel.fn)
    wrapped = triton.runtime.autotuner.Heuristics(kernel, ["x_ptr"], {"UNUSED": lambda args: 1})
    assert jit_function(wrapped, JITFunction) is kernel
    assert jit_function(kernel.fn, JITFunction) is None
    assert jit_function(42, JITFunction) is None


def test_triton_compiled_counts_each_kernels_compiled_variants(monkeypatch):
    before = triton_compiled()
    kernel = JITFunction(_kernel_source)
    variants = {("signature", i): object() for i in range(3)}  # Triton's kernel cache: one per specialisation
    kernel.device_caches = {0: (variants, {}, None, None, None)}
    module = types.ModuleType("loraplane._compiles_probe")
    module.kernel, module.same_kernel = kernel, kernel  # counted once
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert triton_compiled() == before + 3
