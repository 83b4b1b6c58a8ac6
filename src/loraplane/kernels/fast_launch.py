"""Re-launch a compiled Triton kernel without Triton's per-call binding: host time per launch.

``fn[grid](*args, **constexprs)`` binds and specializes every argument, builds a cache key, looks the
kernel up and checks its globals on each call. An eager engine step makes two launches per (layer,
module), so that Python work is most of the step's LoRA host time. ``FastLaunch`` keeps one launch's
grid and compile-time values; its first call goes through Triton (compiling if needed) and records the
exact arguments Triton hands to the compiled kernel's launcher. Later calls whose run-time arguments
specialize the same way (ints alike modulo 16, at 1 and in 32-bit range; tensors of the same dtype and
16-byte alignment: what Triton keys its specialization on) call that launcher directly on the current
stream. Anything else, or a Triton whose launcher is not the one recorded, takes Triton's own path:
the fast path is an optimization that can switch itself off, never a second semantics.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["FastLaunch", "compile_only", "compile_queued", "launch_counts"]

_ENABLED = os.environ.get("LORAPLANE_TRITON_FAST_LAUNCH", "1") != "0"

_COUNTS = {"direct": 0, "triton": 0}
"""Launches so far: ``direct`` called the recorded launcher, ``triton`` went through Triton's binding (a
first launch, a new specialization, or the fast path off). Benchmarks report both per window: a step
whose launches all go through Triton spends a multiple of its host time on it."""


_LOCAL = threading.local()
"""``queue``: while ``compile_only`` is active in this thread, the launch shapes seen, by ``FastLaunch._key``."""


def launch_counts() -> dict[str, int]:
    """A copy of the launch counters (``direct`` / ``triton``)."""
    return dict(_COUNTS)


@contextlib.contextmanager
def compile_only():
    """Within (this thread): a launch that is not recorded yet launches nothing; its shape (kernel,
    grid, compile-time values, options, and its arguments with each tensor replaced by a small one of the
    same dtype, device and alignment, all Triton specializes on) goes in the yielded dict, once per shape,
    for ``compile_queued``. The step's own tensors are not kept."""
    _LOCAL.queue = queued = {}
    try:
        yield queued
    finally:
        _LOCAL.queue = None


_STAND_INS: dict[tuple, torch.Tensor] = {}


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s dtype and device, 16-byte aligned where ``t`` is (else one element off)."""
    aligned = t.data_ptr() % 16 == 0
    key = (t.dtype, t.device, aligned)
    if key not in _STAND_INS:
        buf = torch.empty(32, dtype=t.dtype, device=t.device)  # fresh allocations are 256-byte aligned
        _STAND_INS[key] = buf if aligned or t.element_size() % 16 == 0 else buf[1:]
    return _STAND_INS[key]


def compile_queued(queued: dict, threads: int) -> int:
    """Compile every shape ``compile_only`` queued (Triton's ``warmup``: no launch), on ``threads`` threads
    through Triton's ``AsyncCompileMode`` where it has one (3.4 and later), else one after another. Compiling
    runs mostly outside the GIL. Returns how many shapes were queued."""
    try:
        from triton.runtime import _async_compile
    except ImportError:
        _async_compile = None

    def compile_all() -> None:
        for launch, args in queued.values():
            launch.fn.warmup(*args, grid=launch.grid, **launch.constexprs, **launch.options)

    if _async_compile is None or threads <= 1:
        compile_all()
        return len(queued)
    # Only warmup calls run under the mode: a launch inside it would meet a kernel still compiling. A shape
    # that fails to compile is left for its first launch, which compiles it again and raises its error;
    # the mode is switched off whatever happens (its exit does not, when a result raises).
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool:
            with _async_compile.AsyncCompileMode(pool, ignore_errors=True):
                compile_all()
    finally:
        _async_compile.active_mode.set(None)
    return len(queued)


def _unset(hook) -> bool:
    """A launch hook that does nothing: None (older Triton) or an empty hook chain (``.calls``)."""
    return hook is None or (not getattr(hook, "calls", True) and callable(hook))


def _no_hooks() -> bool:
    """No launch hooks installed (profilers add them): the only state the fast path runs in."""
    try:
        from triton import knobs

        return _unset(knobs.runtime.launch_enter_hook) and _unset(knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):
        return True


def _current_stream(device: int):
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(device)


def _on_gpu(args: tuple) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_cuda


def _no_ints(args: tuple) -> tuple:
    return ()


def _signature(args: tuple) -> tuple:
    """What Triton specializes a launch on, for the run-time arguments: tensors by dtype and 16-byte
    alignment of their data pointer; ints by divisibility by 16, equality to 1 and 32-bit range."""
    return tuple(
        (a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, torch.Tensor)
        else (type(a), a % 16 == 0, a == 1, -(1 << 31) <= a < (1 << 31))
        for a in args
    )


class FastLaunch:
    """One kernel launch shape: ``FastLaunch(fn, grid, constexprs, num_warps=.., num_stages=..)(*args)``.

    ``args`` are the kernel's run-time parameters in order (tensors and ints); ``constexprs`` the rest,
    by name. Returns nothing; raises what Triton raises (compilation errors on the first call).
    """

    __slots__ = ("fn", "grid", "constexprs", "options", "_run", "_tail", "_sig", "_device", "_tried", "_grid3",
                 "_tensors", "_ints_at", "_ints", "_arity")  # fmt: skip

    def __init__(self, fn, grid: tuple[int, ...], constexprs: dict, **options) -> None:
        self.fn, self.grid, self.constexprs, self.options = fn, grid, constexprs, options
        self._run = None  # (launcher, function, packed metadata) once recorded
        self._tail: tuple = ()
        self._sig: tuple | None = None
        self._device = -1
        self._tried = False  # recording is tried once; if Triton's call does not fit, its path stays
        self._grid3 = (*grid, 1, 1)[:3]
        self._tensors: tuple = ()  # (position, dtype, 16-byte aligned) of each tensor argument, once recorded
        self._ints_at = _no_ints  # the int arguments, as a tuple (None: not all plain ints) ...
        self._ints: object = None  # ... and their values at the last launch that fitted
        self._arity = -1

    def __call__(self, *args) -> None:
        if self._run is not None and self._fits(args) and _no_hooks():
            run, function, packed = self._run
            _COUNTS["direct"] += 1
            g = self._grid3
            # No launch metadata and no hooks: the launcher then calls nothing back into Python.
            run(g[0], g[1], g[2], _current_stream(self._device), function, packed, None, None, None, *args,
                *self._tail)  # fmt: skip
            return
        self._slow(args)

    def _fits(self, args: tuple) -> bool:
        """``args`` specialize as the recorded ones (``_signature``). Only the tensors are looked at when the
        ints equal the last fitting launch's (every layer of a step passes the same ints): a full
        ``_signature`` per launch was about half of a launch's Python time."""
        if len(args) != self._arity:
            return False
        for i, dtype, aligned in self._tensors:
            t = args[i]
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype is not dtype
                or (t.data_ptr() % 16 == 0) is not aligned
            ):
                return False
        ints = self._ints_at(args) if self._ints_at is not None else None
        if ints is not None and ints == self._ints:
            return True
        if _signature(args) != self._sig:
            return False
        self._ints = ints
        return True

    def _take(self, recorded: tuple, args: tuple) -> None:
        """Launch directly from now on with ``recorded`` (launcher, constexpr tail, signature, device)."""
        self._run, self._tail, self._sig, self._device = recorded
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ints = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
        self._arity = len(args)
        self._tensors = tuple((i, args[i].dtype, args[i].data_ptr() % 16 == 0) for i in tensors)
        self._ints_at = operator.itemgetter(*ints) if ints else _no_ints
        if any(type(args[i]) is not int for i in ints):  # True == 1, yet Triton types them apart: full checks
            self._ints_at = None
        self._ints = self._ints_at(args) if self._ints_at is not None else None

    def _slow(self, args: tuple) -> None:
        queue = getattr(_LOCAL, "queue", None)
        if queue is not None:
            if (key := self._key(args)) not in queue:
                queue[key] = (self, tuple(_stand_in(a) if isinstance(a, torch.Tensor) else a for a in args))
            return
        kernel = None
        if not self._tried and _ENABLED and _on_gpu(args) and _no_hooks():
            self._tried = True
            known = _RECORDED.get(self._key(args))
            if known is not None:  # recorded by an earlier step's launch of the same kernel and shape
                self._take(known, args)
                self(*args)
                return
            try:  # compiles, launches nothing
                kernel = self.fn.warmup(*args, grid=self.grid, **self.constexprs, **self.options)
            except (AttributeError, TypeError):
                kernel = None
        slot = _launcher_slot(kernel) if kernel is not None else None
        _COUNTS["triton"] += 1  # below, one launch through Triton's binding
        if slot is None:
            self.fn[self.grid](*args, **self.constexprs, **self.options)
            return
        attr, run = slot
        seen: list[tuple] = []

        def spy(*call):
            seen.append(call)
            return run(*call)

        setattr(kernel, attr, spy)
        try:  # the one real launch of this call, through Triton
            self.fn[self.grid](*args, **self.constexprs, **self.options)
        finally:
            setattr(kernel, attr, run)
        if len(seen) == 1:
            self._adopt(kernel, run, seen[0], args)

    def _adopt(self, kernel, run, call: tuple, args: tuple) -> None:
        """Keep the launcher when Triton called it as (grid, stream, function, metadata, launch metadata,
        two hooks that do nothing, our args in order, then a constexpr tail); else stay on Triton's path."""
        head, rest = call[:9], call[9:]
        if (
            len(head) < 9
            or len(rest) < len(args)
            or any(r is not a for r, a in zip(rest, args, strict=False))
        ):
            return
        function, packed = getattr(kernel, "function", None), getattr(kernel, "packed_metadata", None)
        if head[4] is not function or head[5] is not packed or not (_unset(head[7]) and _unset(head[8])):
            return
        device = args[0].device
        index = (
            device.index if device.index is not None or not args[0].is_cuda else torch.cuda.current_device()
        )
        recorded = ((run, function, packed), tuple(rest[len(args) :]), _signature(args), index)
        self._take(recorded, args)
        _RECORDED[self._key(args)] = recorded

    def _key(self, args: tuple) -> tuple:
        """What identifies a compiled kernel and its launcher: function, compile-time values, options,
        the run-time arguments' specialization and the device."""
        return (self.fn, tuple(self.constexprs.items()), tuple(self.options.items()), _signature(args),
                str(args[0].device))  # fmt: skip


_RECORDED: dict[tuple, tuple] = {}
"""Launchers recorded so far, shared by every ``FastLaunch`` (plans are rebuilt each step; their first
launch then needs no second pass through Triton)."""


def _launcher_slot(kernel):
    """(attribute name, launcher) of a compiled kernel: Triton keeps the launcher behind a ``run``
    property backed by ``_run`` or as a plain ``run`` attribute, depending on its version."""
    try:
        run = kernel.run  # loads the binary; raises OutOfResources like a launch would
    except AttributeError:
        return None
    if isinstance(getattr(type(kernel), "run", None), property):
        return ("_run", run) if getattr(kernel, "_run", None) is run else None
    return ("run", run) if "run" in getattr(kernel, "__dict__", {}) else None
