"""Adapters of one shape share one file layout: after a full parse, the next file with the same header is
stacked with one strided gather per factor, and no per-tensor Python work.

A PEFT file of a given base, rank pattern and module set has the same header bytes whatever its values
(names, dtypes, shapes and offsets only). The first file of a header is parsed and checked tensor by tensor
(``weights._factors``); when every module has every layer at one rank, its tensors lie in the file at a
fixed distance from one layer to the next (in the file's order, which sorts names as text: layer 10 before
layer 2), and the file's dtype is the serving dtype, the layout is kept. A later file with the same header
bytes, config and file size is then one view of the data per factor (``as_strided`` over the layers in
file order) and one ``index_select`` into the stacked buffer in layer order: a handful of tensor calls per
module, where the full parse makes a few thousand. Loads hold the GIL that much less, so the engine thread
and the other loads keep stepping.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

MAX_LAYOUTS = 64  # distinct adapter shapes remembered (a few KB of offsets each, plus the header bytes)


@dataclass(frozen=True, slots=True)
class _Factor:
    first: int  # byte offset in the file of the first tensor in file order
    stride: int  # elements from one layer's tensor to the next, in file order
    numel: int  # elements of one layer's tensor
    order: torch.Tensor  # [L] int64: position in file order of layer 0, 1, ...


@dataclass(frozen=True, slots=True)
class _Module:
    name: str
    a: _Factor
    b: _Factor
    scales: tuple[float, ...]  # per layer


@dataclass(frozen=True, slots=True)
class Layout:
    size: int  # bytes of the whole file
    dtype: torch.dtype
    modules: tuple[_Module, ...]


class Layouts:
    """Known layouts by (header bytes, config, engine shape); bounded, any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: OrderedDict[tuple, Layout] = OrderedDict()

    def get(self, key: tuple, size: int) -> Layout | None:
        with self._lock:
            layout = self._known.get(key)
            if layout is not None:
                self._known.move_to_end(key)
        return layout if layout is not None and layout.size == size else None

    def __len__(self) -> int:
        return len(self._known)

    def clear(self) -> None:
        with self._lock:
            self._known.clear()

    def put(self, key: tuple, layout: Layout) -> None:
        with self._lock:
            self._known[key] = layout
            while len(self._known) > MAX_LAYOUTS:
                self._known.popitem(last=False)


def header_key(buf: memoryview, *rest) -> tuple:
    """The key of a file's layout: its header bytes (length prefix included) and what else decides the
    checks (the adapter config, the engine's shapes, rank limit and dtype)."""
    n = int.from_bytes(buf[:8], "little") if len(buf) >= 8 else 0
    return (bytes(buf[: 8 + n]), *rest)


def layout_of(
    factors: dict, data: torch.Tensor, size: int, num_layers: int, dtype: torch.dtype
) -> Layout | None:
    """The layout of a fully parsed file (``factors``: module -> {layer: (a, b, scale)}, views of ``data``, the
    file as uint8), or None when it does not have one (a layer missing or at another rank, a dtype other
    than ``dtype``, a tensor copied out of the file, uneven spacing)."""
    base, modules = data.data_ptr(), []
    for module, layers in factors.items():
        if len(layers) != num_layers:
            return None
        pairs = [layers[i] for i in range(num_layers)]
        a = _factor([p[0] for p in pairs], base, data.numel(), dtype)
        b = _factor([p[1] for p in pairs], base, data.numel(), dtype)
        if a is None or b is None or len({p[0].shape for p in pairs}) != 1:
            return None
        modules.append(_Module(module, a, b, tuple(p[2] for p in pairs)))
    return Layout(size, dtype, tuple(modules))


def _factor(tensors: list[torch.Tensor], base: int, nbytes: int, dtype: torch.dtype) -> _Factor | None:
    if any(t.dtype != dtype or not t.is_contiguous() for t in tensors):
        return None
    elem = tensors[0].element_size()
    offsets = [t.data_ptr() - base for t in tensors]
    if any(not 0 <= o < nbytes or o % elem for o in offsets):
        return None  # not a view of the file (copied for alignment)
    ordered = sorted(offsets)
    steps = {q - p for p, q in zip(ordered, ordered[1:], strict=False)}
    if len(steps) > 1 or (steps and next(iter(steps)) % elem):
        return None
    stride = next(iter(steps)) // elem if steps else tensors[0].numel()
    position = {o: i for i, o in enumerate(ordered)}
    order = torch.tensor([position[o] for o in offsets], dtype=torch.int64)
    return _Factor(ordered[0], stride, tensors[0].numel(), order)


def fill(layout: Layout, data: torch.Tensor, out_a: dict, out_b: dict, module: _Module) -> float | None:
    """One module's stacked A [L, r, in] and B [L, out, r] from the file ``data`` (uint8). Returns the
    layers' one scale when they share it (B stays as on file; the slot applies it), else None with each
    layer's scale folded into its B (a 16-bit ``mul_`` computes in fp32 and rounds once, as PEFT's)."""
    for factor, dst in ((module.a, out_a[module.name]), (module.b, out_b[module.name])):
        torch.index_select(
            _strided(data, factor, layout.dtype), 0, factor.order, out=dst.view(dst.shape[0], -1)
        )
    scale = shared_scale(module.scales)
    if scale is None:
        out_b[module.name].mul_(torch.tensor(module.scales).view(-1, 1, 1))
    return scale


def shared_scale(scales) -> float | None:
    """The one scale of a module's layers, or None when they differ."""
    distinct = set(scales)
    return float(next(iter(distinct))) if len(distinct) == 1 else None


def _strided(data: torch.Tensor, factor: _Factor, dtype: torch.dtype) -> torch.Tensor:
    """[L, numel] over the file's tensors of one factor, in file order (no copy)."""
    elem = torch.empty((), dtype=dtype).element_size()
    count = factor.order.numel()
    span = ((count - 1) * factor.stride + factor.numel) * elem
    seg = data[factor.first : factor.first + span].view(dtype)
    return seg.as_strided((count, factor.numel), (factor.stride, 1))
