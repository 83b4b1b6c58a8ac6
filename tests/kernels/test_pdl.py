"""Programmatic dependent launch (kernels/pdl.py): every kernel compiled to take it waits for the kernel
ahead, and it is only asked for where it exists."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from loraplane.engine.model import attention, fused_ops
from loraplane.kernels import pdl, triton_decode
from tests.kernels import pdl_producer

MODULES = (triton_decode, fused_ops, attention, pdl_producer)


def _gdc_kernels() -> list[tuple[str, ast.FunctionDef]]:
    """The Triton kernels (``*_kernel`` functions under a ``triton.jit`` decorator) with a GDC parameter."""
    found = []
    for module in MODULES:
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if not (isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")):
                continue
            jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
            if jit and any(a.arg == "GDC" for a in node.args.args):
                found.append((f"{module.__name__}.{node.name}", node))
    return found


def _waits(fn: ast.FunctionDef) -> bool:
    return any(
        isinstance(n, ast.Call) and ast.unparse(n) == "wait_for_kernel_ahead(GDC)" for n in ast.walk(fn)
    )


def test_every_kernel_launched_with_pdl_waits_for_the_kernel_ahead():
    """A kernel launched with ``launch_pdl`` that never executes ``griddepcontrol.wait`` may read what the
    kernel ahead has not written yet, and lets the kernel after it finish before that one has."""
    kernels = _gdc_kernels()
    names = {name.rsplit(".", 1)[1] for name, _ in kernels}
    assert {"_shrink_decode_kernel", "_expand_decode_kernel", "_rmsnorm_kernel", "_paged_decode_kernel",
            "_merge_splits_kernel", "_rope_store_kernel", "_silu_mul_kernel", "_write_kv_kernel"} <= names  # fmt: skip
    assert [name for name, fn in kernels if not _waits(fn)] == []


def test_pdl_is_asked_for_only_where_it_exists(monkeypatch):
    """Never on a CPU tensor; never under Triton's interpreter (it runs no inline assembly)."""
    assert not pdl.pdl_available(torch.zeros(1))
    assert pdl.pdl_option(False) == {} and pdl.pdl_option(True) == {"launch_pdl": True}
    if torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not pdl.pdl_available(torch.zeros(1, device="cuda"))


@pytest.mark.gpu
def test_gpu_pdl_is_there_on_hopper():
    x = torch.zeros(1, device="cuda")
    assert pdl.pdl_available(x) == (torch.cuda.get_device_capability()[0] >= 9)
