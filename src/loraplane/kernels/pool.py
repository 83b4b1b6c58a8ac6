"""A paged pool of LoRA weights: every adapter costs pages in proportion to its own rank.

Layout. The pool is a set of ``num_pages`` pages of ``page_rank`` rank-rows each. An adapter of rank r
owns ceil(r / page_rank) pages, anywhere in the pool, listed in its row of ``page_table``. Rank-row j of
adapter ``slot`` lives at physical row ``page_table[slot, j // page_rank] * page_rank + j % page_rank`` of
every (layer, module) weight buffer:

- ``a[(layer, module)]``:  [num_slices, num_rows, in_dim]   rows of A_s (A_s is [r, in_dim])
- ``bt[(layer, module)]``: [num_rows, sum(out_dims)]         rows of B^T, slices side by side
  (B_s is [out_dims[s], r], so B_s^T occupies columns out_start[s]:out_start[s+1])

One page table serves every layer and module, so one allocation places an adapter everywhere. Pages are
interchangeable, so loading and evicting never fragments: any free pages serve any rank.
"""

from __future__ import annotations

import math

import torch

from loraplane.kernels.layer_stack import stack_layers, to_device
from loraplane.kernels.module_spec import RANK_LIMIT, ModuleSpec, check_max_rank, rank_error

__all__ = [
    "RANK_LIMIT",
    "LoRAPool",
    "ModuleSpec",
    "PoolFullError",
    "check_max_rank",
    "lora_scale",
    "rank_error",
]


def lora_scale(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """PEFT's scaling: alpha / sqrt(r) with rsLoRA, else alpha / r."""
    if rank <= 0:
        raise ValueError(f"rank must be positive, got {rank}")
    return float(alpha) / (math.sqrt(rank) if use_rslora else rank)


def resolve_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so device comparisons with tensors' devices hold."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class PoolFullError(RuntimeError):
    """No free adapter slot or not enough free pages for the requested rank."""


class LoRAPool:
    """Adapters held in a byte budget, addressed by slot. Not thread-safe; the engine owns it.

    ``allocate(rank, scale) -> slot``; ``write(slot, layer, module, slice_idx, A, B)``; ``free(slot)``.
    Device tables read by the kernels: ``page_table`` [max_adapters, max_pages] int32, ``ranks``
    [max_adapters] int32, ``scales`` [max_adapters] float32. Host mirrors: ``rank_of(slot)``.
    """

    def __init__(
        self,
        modules: dict[str, ModuleSpec],
        num_layers: int,
        budget_bytes: int,
        *,
        page_rank: int = 8,
        max_rank: int = 128,
        max_adapters: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        buffers: tuple[dict, dict] | None = None,
    ) -> None:
        """``buffers``: (a, bt) dicts of existing tensors, keyed and shaped as the pool's own would be (any
        row stride: views over memory the caller owns); the pool then has their row count of pages and
        allocates nothing. A subclass may hand out pages its own way (``_take_pages``, ``_give_pages``)."""
        if not modules or not all(isinstance(s, ModuleSpec) for s in modules.values()):
            raise ValueError("modules must map names to ModuleSpec")
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        if page_rank <= 0 or page_rank & (page_rank - 1):
            raise ValueError(f"page_rank must be a power of two, got {page_rank}")
        check_max_rank("max_rank", max_rank, page_rank)
        self.modules = dict(modules)
        self.num_layers = num_layers
        self.page_rank = page_rank
        self.max_rank = max_rank
        self.max_pages = max_rank // page_rank
        self.dtype = dtype
        self.device = resolve_device(device)
        self.page_bytes = self.page_bytes_for(modules, num_layers, page_rank, dtype)
        self.num_pages = int(budget_bytes) // self.page_bytes
        if buffers is not None:
            self.num_pages = next(iter(buffers[1].values())).shape[0] // page_rank
        if self.num_pages < 1:
            raise ValueError(
                f"budget_bytes={budget_bytes} holds no page (one page of {page_rank} rank-rows costs {self.page_bytes} B)"
            )
        self.max_adapters = max_adapters if max_adapters is not None else self.num_pages
        if self.max_adapters < 1:
            raise ValueError(f"max_adapters must be positive, got {self.max_adapters}")
        rows = self.num_pages * page_rank
        kw = dict(dtype=dtype, device=self.device)
        if buffers is not None:
            self.a, self.bt = self._checked_buffers(buffers, rows)
        else:
            self._allocate_buffers(rows, kw)
        self.page_table = torch.zeros(
            self.max_adapters, self.max_pages, dtype=torch.int32, device=self.device
        )
        self.ranks = torch.zeros(self.max_adapters, dtype=torch.int32, device=self.device)
        self.scales = torch.zeros(self.max_adapters, dtype=torch.float32, device=self.device)
        # Lowest page / slot first: keeps tests deterministic; any order would be correct.
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._free_slots = list(range(self.max_adapters - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._rank: dict[int, int] = {}
        self._scale: dict[int, float] = {}
        self._starts: dict[str, torch.Tensor] = {}
        # Per module, every layer's buffer as one view (None where they are apart): O(1) kernels per load.
        layers = range(num_layers)
        self._a_all = {m: stack_layers([self.a[(l, m)] for l in layers]) for m in modules}  # [L, S, R, in]
        self._bt_all = {m: stack_layers([self.bt[(l, m)] for l in layers]) for m in modules}  # [L, R, out]

    def _allocate_buffers(self, rows: int, kw: dict) -> None:
        # One tensor per module holds every layer (each layer's [S, R, in] / [R, out] stays contiguous).
        L, specs = self.num_layers, self.modules
        a = {m: torch.zeros(L, s.num_slices, rows, s.in_dim, **kw) for m, s in specs.items()}
        bt = {m: torch.zeros(L, rows, s.out_total, **kw) for m, s in specs.items()}
        self.a = {(l, m): a[m][l] for l, m in self._keys()}
        self.bt = {(l, m): bt[m][l] for l, m in self._keys()}

    def _checked_buffers(self, buffers: tuple[dict, dict], rows: int) -> tuple[dict, dict]:
        a, bt = buffers
        for key, spec in ((k, self.modules[k[1]]) for k in self._keys()):
            ta, tb = a.get(key), bt.get(key)
            ok = ta is not None and tb is not None
            ok = (
                ok and ta.shape == (spec.num_slices, rows, spec.in_dim) and tb.shape == (rows, spec.out_total)
            )
            ok = ok and ta.dtype == tb.dtype == self.dtype and ta.device == tb.device == self.device
            if not ok or ta.stride(2) != 1 or tb.stride(1) != 1:
                raise ValueError(
                    f"buffers {key}: need a [{spec.num_slices}, {rows}, {spec.in_dim}] and bt [{rows}, "
                    f"{spec.out_total}], {self.dtype} on {self.device}, contiguous along the last dim"
                )
        return dict(a), dict(bt)

    def _keys(self) -> list[tuple[int, str]]:
        return [(l, name) for l in range(self.num_layers) for name in self.modules]

    @staticmethod
    def page_bytes_for(
        modules: dict[str, ModuleSpec], num_layers: int, page_rank: int, dtype: torch.dtype
    ) -> int:
        """Bytes one page costs across every (layer, module): size a budget without building a pool."""
        elem = torch.empty((), dtype=dtype).element_size()
        return page_rank * num_layers * elem * sum(s.row_elems() for s in modules.values())

    # -- accounting -------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def bytes_for_rank(self, rank: int) -> int:
        return self.pages_for_rank(rank) * self.page_bytes

    def pages_for_rank(self, rank: int) -> int:
        return -(-rank // self.page_rank)

    def can_allocate(self, rank: int) -> bool:
        return bool(self._free_slots) and self.pages_for_rank(rank) <= len(self._free_pages)

    def rank_of(self, slot: int) -> int:
        self._check_slot(slot)
        return self._rank[slot]

    def scale_of(self, slot: int) -> float:
        self._check_slot(slot)
        return self._scale[slot]

    def pages_of(self, slot: int) -> list[int]:
        self._check_slot(slot)
        return list(self._pages[slot])

    def host_ranks(self) -> list[int]:
        """Rank per slot (0 when free), for the batch-metadata builder."""
        out = [0] * self.max_adapters
        for slot, r in self._rank.items():
            out[slot] = r
        return out

    def host_scales(self) -> list[float]:
        """Scale per slot (0.0 when free)."""
        out = [0.0] * self.max_adapters
        for slot, s in self._scale.items():
            out[slot] = s
        return out

    def out_starts_tensor(self, module: str) -> torch.Tensor:
        """``ModuleSpec.out_starts`` as an int32 tensor on the pool's device (made once)."""
        if module not in self._starts:
            self._starts[module] = torch.tensor(
                self.modules[module].out_starts, dtype=torch.int32, device=self.device
            )
        return self._starts[module]

    def rows_of(self, slot: int) -> torch.Tensor:
        """Physical row of each rank-row of ``slot``: int64 [rank] on the pool's device (queued, no sync)."""
        pages, pr = self.pages_of(slot), self.page_rank
        return to_device(
            [pages[j // pr] * pr + j % pr for j in range(self._rank[slot])], torch.int64, self.device
        )

    # -- lifecycle --------------------------------------------------------------------------------------
    zero_a = False  # whether ``allocate`` zeroes A rows too (a pool whose rows held other data than LoRA)

    def allocate(self, rank: int, scale: float, slot: int | None = None, *, zero: bool = True) -> int:
        """Reserve pages for an adapter of ``rank``; returns its slot (``slot`` when given: it must be
        free; pools that share one slot numbering can then share one batch metadata). Its B rows start
        at zero, so a module never written contributes nothing; ``zero=False`` skips that for a caller that
        writes every row of every layer (``write_layers``) before a step reads the slot."""
        if not isinstance(rank, int) or not 0 < rank <= self.max_rank:
            raise ValueError(rank_error("rank", rank, self.max_rank))
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")
        need = self.pages_for_rank(rank)
        if not self._free_slots:
            raise PoolFullError(f"no free adapter slot (max_adapters={self.max_adapters})")
        if need > self.free_pages:
            raise PoolFullError(f"rank {rank} needs {need} pages, {self.free_pages} free")
        if slot is None:
            slot = self._free_slots.pop()
        elif slot in self._free_slots:
            self._free_slots.remove(slot)
        else:
            raise PoolFullError(f"slot {slot!r} is not a free slot of this pool")
        pages = self._take_pages(need)
        self._pages[slot], self._rank[slot], self._scale[slot] = pages, rank, float(scale)
        # The slot's table row, rank and scale (as float32 bits) in one queued copy: no sync per load.
        bits = torch.tensor(float(scale), dtype=torch.float32).view(torch.int32).item()
        vals = to_device([*pages, *[0] * (self.max_pages - need), rank, bits], torch.int32, self.device)
        self.page_table[slot].copy_(vals[: self.max_pages])
        self.ranks[slot : slot + 1].copy_(vals[self.max_pages : -1])
        self.scales[slot : slot + 1].copy_(vals[-1:].view(torch.float32))
        if zero:
            self._zero_rows(self.rows_of(slot))
        return slot

    def _zero_rows(self, rows: torch.Tensor) -> None:
        """Zero these physical rows of B (and of A when ``zero_a``) in every layer: a kernel per module."""
        for m in self.modules:
            for stacked, per_layer, dim in ((self._bt_all[m], self.bt, 1), (self._a_all[m], self.a, 2)):
                if dim == 2 and not self.zero_a:
                    continue
                if stacked is not None:
                    stacked.index_fill_(dim, rows, 0)
                    continue
                for layer in range(self.num_layers):
                    per_layer[(layer, m)].index_fill_(dim - 1, rows, 0)

    def write_layers(self, slot: int, module: str, a: torch.Tensor, bt: torch.Tensor) -> None:
        """Store a single-slice module's factors for every layer and every rank-row of ``slot`` at once:
        ``a`` [L, rank, in_dim], ``bt`` = B^T [L, rank, out] (any strides), both in the pool's dtype and on
        its device. One indexed copy per factor where the layers are one view, else one per layer."""
        self._check_slot(slot)
        spec, rank = self.modules[module], self._rank[slot]
        if spec.num_slices != 1:
            raise ValueError(f"write_layers: module {module!r} has {spec.num_slices} slices; use write")
        want_a, want_bt = (self.num_layers, rank, spec.in_dim), (self.num_layers, rank, spec.out_total)
        if a.shape != want_a or bt.shape != want_bt:
            raise ValueError(
                f"write_layers: need a {list(want_a)} and bt {list(want_bt)}, got {list(a.shape)} and "
                f"{list(bt.shape)}"
            )
        rows = self.rows_of(slot)  # int64 [rank]
        a_all, bt_all = self._a_all[module], self._bt_all[module]
        if a_all is not None and bt_all is not None:
            a_all[:, 0].index_copy_(1, rows, a)
            bt_all.index_copy_(1, rows, bt)
            return
        for layer in range(self.num_layers):
            self.a[(layer, module)][0].index_copy_(0, rows, a[layer])
            self.bt[(layer, module)].index_copy_(0, rows, bt[layer])

    def free(self, slot: int) -> None:
        """Return the adapter's pages and slot. Its data stays until the pages are reused."""
        self._check_slot(slot)
        self._give_pages(self._pages.pop(slot))
        del self._rank[slot], self._scale[slot]
        self.ranks[slot] = 0
        self.scales[slot] = 0.0
        self._free_slots.append(slot)

    def write(
        self, slot: int, layer: int, module: str, slice_idx: int, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        """Store one slice's factors: ``a`` = lora_A [r', in_dim], ``b`` = lora_B [out_dims[slice], r'].

        r' may be below the adapter's rank (PEFT rank_pattern): the remaining B rows stay zero.
        The scale is not folded in; the kernels apply ``scales[slot]``.
        """
        self._check_slot(slot)
        if (layer, module) not in self.a:
            raise KeyError(f"no (layer={layer}, module={module!r}) in this pool")
        spec = self.modules[module]
        if not 0 <= slice_idx < spec.num_slices:
            raise ValueError(f"slice_idx must be in [0, {spec.num_slices}), got {slice_idx}")
        rank = self._rank[slot]
        if a.dim() != 2 or a.shape[1] != spec.in_dim or not 0 < a.shape[0] <= rank:
            raise ValueError(f"a must be [r<={rank}, {spec.in_dim}], got {tuple(a.shape)}")
        width = spec.out_dims[slice_idx]
        if b.shape != (width, a.shape[0]):
            raise ValueError(f"b must be [{width}, {a.shape[0]}], got {tuple(b.shape)}")
        rows = self.rows_of(slot)[: a.shape[0]]
        c0 = spec.out_starts[slice_idx]
        self.a[(layer, module)][slice_idx].index_copy_(0, rows, a.to(self.device, self.dtype))
        bt = self.bt[(layer, module)]
        bt[:, c0 : c0 + width].index_copy_(0, rows, b.t().to(self.device, self.dtype))
        if a.shape[0] < rank:
            bt[:, c0 : c0 + width].index_fill_(0, self.rows_of(slot)[a.shape[0] :], 0)

    def _take_pages(self, need: int) -> list[int]:
        return [self._free_pages.pop() for _ in range(need)]

    def _give_pages(self, pages: list[int]) -> None:
        self._free_pages.extend(reversed(pages))

    def _check_slot(self, slot: int) -> None:
        if slot not in self._rank:
            raise KeyError(f"slot {slot!r} is not allocated")
