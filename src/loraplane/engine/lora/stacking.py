"""An adapter's factors on the host (``AdapterWeights``), and how a parsed PEFT file becomes them: every module's
layers stacked into one buffer, each module filled on a small thread pool by a few large tensor ops that
release the GIL, with one NaN/Inf check per factor. ``weights.py`` reads, validates and hashes the file."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from loraplane.engine.lora.layout import Layout, fill, shared_scale

# PEFT names, in packing order
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Alloc = Callable[[int], torch.Tensor]  # nbytes -> a uint8 host tensor the result is carved from


@dataclass(slots=True)
class AdapterWeights:
    """One adapter's factors on the host, in the pool's dtype. A module whose layers share one scale keeps B
    as the file has it and its scale in ``scales`` (the kernels apply it per slot, in fp32): no pass over B on
    the load's path. Layers with different scales (PEFT ``alpha_pattern`` by layer) have theirs folded into
    B instead, and no entry in ``scales``."""

    a: dict[str, torch.Tensor]  # module -> [L, r_m, in]
    b: dict[str, torch.Tensor]  # module -> [L, out, r_m] (times its scale when the module has no ``scales``)
    ranks: dict[str, int] = field(default_factory=dict)  # module -> r_m (largest over layers)
    scales: dict[str, float] = field(default_factory=dict)  # module -> the scale its slot applies
    file_id: tuple | None = None  # the weights file's identity (``file_identity``) when it was read
    sha256: str | None = None  # "sha256:<hex>" of the weights file it was read from (see ``digest``)
    timings: dict[str, float] = field(default_factory=dict)  # read / hash / stack seconds
    hashing: Future | None = None  # (digest, seconds) of a hash still running when the load returned

    def digest(self) -> str | None:
        """``sha256``, waiting for the hash of a first read (no digest to check) if it is still running."""
        if self.sha256 is None and self.hashing is not None:
            self.sha256, self.timings["hash"] = self.hashing.result()
            self.hashing = None
        return self.sha256

    @property
    def rank(self) -> int:
        return max(self.ranks.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def pin(self) -> AdapterWeights:
        """Page-locked copies, so host-to-device copies can run asynchronously (CUDA only)."""
        if all(t.is_pinned() for t in (*self.a.values(), *self.b.values())):
            return self
        self.a = {m: t.pin_memory() for m, t in self.a.items()}
        self.b = {m: t.pin_memory() for m, t in self.b.items()}
        return self


def new_buffer(pin: bool) -> Alloc:
    return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _carve(
    ranks: dict[str, int], shapes, num_layers: int, dtype: torch.dtype, alloc: Alloc
) -> AdapterWeights:
    """Every module's stacked pair, uninitialised, carved out of one buffer from ``alloc``."""
    plan = [(m, ranks[m], *shapes[m]) for m in TARGET_MODULES if m in ranks]  # (module, r_m, fan_in, fan_out)
    total = sum(num_layers * r_m * (fan_in + fan_out) for _, r_m, fan_in, fan_out in plan)
    elem = torch.empty((), dtype=dtype).element_size()
    flat = alloc(total * elem).view(dtype)  # [total]
    out, at = AdapterWeights(a={}, b={}), 0
    for module, r_m, fan_in, fan_out in plan:
        a_m = flat[at : (at := at + num_layers * r_m * fan_in)].view(num_layers, r_m, fan_in)  # [L, r_m, in]
        b_m = flat[at : (at := at + num_layers * fan_out * r_m)].view(
            num_layers, fan_out, r_m
        )  # [L, out, r_m]
        out.a[module], out.b[module], out.ranks[module] = a_m, b_m, r_m
    return out


def stack_factors(
    factors: dict, shapes, num_layers: int, dtype: torch.dtype, alloc: Alloc
) -> tuple[AdapterWeights, list]:
    """Every module's stacked pair and the modules whose values are not all finite. The modules are filled
    side by side on a small pool (each fill is a few large tensor ops that release the GIL), so one adapter
    on an idle engine loads in about the time of its largest module rather than of all seven."""
    ranks = {m: max(a.shape[0] for a, _, _ in layers.values()) for m, layers in factors.items()}
    out = _carve(ranks, shapes, num_layers, dtype, alloc)
    jobs = {
        m: _STACKER.submit(_fill, out.a[m], out.b[m], factors[m], num_layers, r) for m, r in ranks.items()
    }
    return _gather(out, jobs)


def _gather(out: AdapterWeights, jobs: dict) -> tuple[AdapterWeights, list]:
    """Each module fill's (finite, scale left to the slot or None, B's largest magnitude) into ``out``; the
    modules whose values are not all finite, or whose slot scale times B would overflow the serving dtype
    (as folding it into B would have)."""
    bad = []
    for m, job in jobs.items():
        finite, scale, b_peak = job.result()
        if scale is not None:
            out.scales[m] = scale
            fits = abs(scale) <= torch.finfo(torch.float32).max  # a float32 slot scale; False for NaN
            finite = finite and fits and abs(scale) * b_peak <= torch.finfo(out.b[m].dtype).max
        if not finite:
            bad.append(m)
    return out, bad


def stack_known(
    layout: Layout, data: torch.Tensor, shapes, num_layers: int, alloc: Alloc
) -> tuple[AdapterWeights, list]:
    """``stack_factors`` for a file whose layout is known: one gather per factor (layout.py)."""
    ranks = {m.name: m.a.numel // shapes[m.name][0] for m in layout.modules}
    out = _carve(ranks, shapes, num_layers, layout.dtype, alloc)

    def one(module) -> tuple[bool, float | None, float]:
        scale = fill(layout, data, out.a, out.b, module)
        return _checked(out.a[module.name], out.b[module.name], scale)

    return _gather(out, {m.name: _STACKER.submit(one, m) for m in layout.modules})


def _fill(
    a_m: torch.Tensor, b_m: torch.Tensor, layers: dict, num_layers: int, r_m: int
) -> tuple[bool, float | None, float]:
    """One module's stacked A [L, r_m, in] and B [L, out, r_m], then ``_checked``'s verdict on them: the layers'
    one scale when they share it (B left unscaled for the slot to apply), else None (folded)."""
    scale = shared_scale([s for _, _, s in layers.values()])
    if len(layers) == num_layers and all(a.shape[0] == r_m for a, _, _ in layers.values()):
        _stack_uniform(a_m, b_m, [layers[i] for i in range(num_layers)], fold=scale is None)
    else:  # some layers absent or at a lower rank: zeros there add exactly nothing
        a_m.zero_()
        b_m.zero_()
        for layer, (a, b, s) in layers.items():
            a_m[layer, : a.shape[0]] = a.float().to(a_m.dtype)
            b_m[layer, :, : a.shape[0]] = (b if scale is not None else b.float() * s).to(b_m.dtype)
    return _checked(a_m, b_m, scale)


def _one_thread_on_gpu_hosts() -> None:
    # Several fills at once must not each start a team of intra-op threads on a GPU host (the engine thread
    # needs its core); a CPU-only engine keeps torch's default, which this call would change process-wide.
    if torch.cuda.is_available():
        torch.set_num_threads(1)


_STACKER = ThreadPoolExecutor(
    4, thread_name_prefix="loraplane-adapter-stack", initializer=_one_thread_on_gpu_hosts
)


def _stack_uniform(a_m: torch.Tensor, b_m: torch.Tensor, layers: list, *, fold: bool) -> None:
    """Every layer at the module's rank: one stack per factor. ``fold``: the layers' scales differ, so each
    goes into its B as PEFT computes it, B in fp32 times its scale, rounded once to the serving dtype."""
    a_src = [a for a, _, _ in layers]
    if a_src[0].dtype == a_m.dtype:
        torch.stack(a_src, out=a_m)
    else:
        a_m.copy_(torch.stack(a_src).float())
    b_src = [b for _, b, _ in layers]
    if not fold:
        if b_src[0].dtype == b_m.dtype:
            torch.stack(b_src, out=b_m)  # [L, out, r]
        else:
            b_m.copy_(torch.stack(b_src).float())
        return
    scales = torch.tensor([s for _, _, s in layers], dtype=torch.float32).view(-1, 1, 1)
    b_m.copy_(torch.stack(b_src).float() * scales)


def _checked(a: torch.Tensor, b: torch.Tensor, scale: float | None) -> tuple[bool, float | None, float]:
    """(every value of A and B finite, ``scale``, B's largest magnitude): one min/max pass per factor."""
    b_peak = _finite_peak(b)
    return _finite_peak(a) is not None and b_peak is not None, scale, b_peak or 0.0


def _finite_peak(t: torch.Tensor) -> float | None:
    """The largest magnitude in ``t``, or None when it holds a NaN or an Inf: one min/max pass, which
    propagates both (several times faster on the CPU than ``isfinite``, which writes a mask)."""
    if t.numel() == 0:
        return 0.0
    low, high = (float(x) for x in torch.aminmax(t))
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    return max(abs(low), abs(high))
