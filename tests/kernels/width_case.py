"""Problems with any slice width and start, for the kernel tests, and their float64 reference.

A ``Bank`` is a pool for one module with adapters of the given ranks (two idle residents around them).
Poison, so that a test can prove what was read and written:
- pool rows no active adapter owns (and the tails of partly used pages) are NaN;
- x rows of tokens without an adapter are NaN;
- y columns outside every slice alternate NaN and finite values, in every row; whole rows of tokens
  without an adapter are finite. ``check`` compares those bit for bit and the slices against float64.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from loraplane.kernels import LoRABatchMeta, LoRAPool, ModuleSpec, lora_scale

BAND = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


@dataclass(slots=True)
class Batch:
    seed: int
    meta: LoRABatchMeta
    x: torch.Tensor  # [rows, in_dim]
    y0: torch.Tensor  # [rows, y_width]
    ref: torch.Tensor  # [rows, y_width] float64 (NaN where y0 is NaN)


class Bank:
    def __init__(self, spec: ModuleSpec, ranks: tuple[int, ...], dtype, device="cpu", *, max_rank=128):
        self.seed = secrets.randbits(31)
        self.g = torch.Generator().manual_seed(self.seed)
        self.spec, self.dtype, self.device = spec, dtype, device
        page = LoRAPool.page_bytes_for({"m": spec}, 1, 8, dtype)
        pages = sum(-(-r // 8) for r in ranks) + 2 * -(-max_rank // 8)
        self.pool = LoRAPool({"m": spec}, 1, pages * page, max_rank=max_rank, dtype=dtype, device=device)
        self.dense: dict[int, tuple] = {}
        slots = [self._add(r) for r in (max_rank, *ranks, max_rank)]
        self.active = slots[1:-1]
        owned = torch.zeros(self.pool.num_pages * 8, dtype=torch.bool)
        for slot in self.active:
            owned[self.pool.rows_of(slot).cpu()] = True
        self.pool.a[(0, "m")][:, ~owned.to(device)] = float("nan")
        self.pool.bt[(0, "m")][~owned.to(device)] = float("nan")

    def _add(self, r: int) -> int:
        spec, g = self.spec, self.g
        slot = self.pool.allocate(r, lora_scale(2.0 * r, r, use_rslora=r % 2 == 1) / 2)
        As = [torch.randn(r, spec.in_dim, generator=g) / spec.in_dim**0.5 for _ in spec.out_dims]
        Bs = [torch.randn(w, r, generator=g) / r**0.5 for w in spec.out_dims]
        for s in range(spec.num_slices):
            self.pool.write(slot, 0, "m", s, As[s], Bs[s])
        to64 = lambda ts: [t.to(self.dtype).double() for t in ts]  # noqa: E731
        self.dense[slot] = (r, self.pool.scale_of(slot), to64(As), to64(Bs))
        return slot

    def requests(self, num_tokens: int, per_request: int, base_frac: float = 0.2) -> list[tuple[int, int]]:
        """Requests in row order over the active adapters (round robin), some without an adapter."""
        reqs, t, i = [], 0, 0
        while t < num_tokens:
            n = min(per_request, num_tokens - t)
            base = t > 0 and torch.rand((), generator=self.g).item() < base_frac
            reqs.append((-1, n) if base else (self.active[i % len(self.active)], n))
            i += 0 if base else 1
            t += n
        return reqs

    def batch(self, requests, *, capacity=None, tile_m=16, capture=False, meta=None) -> Batch:
        """x, y0 and the reference for ``requests``; builds into ``meta`` when given (graph buffers)."""
        spec, g = self.spec, self.g
        total = sum(n for _, n in requests)
        if meta is None:
            meta = LoRABatchMeta(
                capacity or total, self.device, tile_m=tile_m, capture=capture, max_rank=self.pool.max_rank
            )
        meta.build(requests, self.pool.host_ranks())
        rows = meta.capacity if meta.capture else total
        slot_of = meta.token_slot[:rows].cpu()
        x = torch.randn(rows, spec.in_dim, generator=g).to(self.dtype)
        x[slot_of < 0] = float("nan")
        y0 = torch.randn(rows, spec.y_width, generator=g).to(self.dtype)
        inside = torch.zeros(spec.y_width, dtype=torch.bool)
        for c, w in zip(spec.slice_starts, spec.out_dims, strict=True):
            inside[c : c + w] = True
        outside = (~inside).nonzero().flatten()
        y0[:, outside[::2]] = float("nan")
        ref = y0.double().clone()
        for slot, idx in meta.groups:
            r, scale, As, Bs = self.dense[slot]
            xs = x[idx].double()  # [n, in_dim]
            for s, (c, w) in enumerate(zip(spec.slice_starts, spec.out_dims, strict=True)):
                ref[idx, c : c + w] += scale * ((xs @ As[s].T) @ Bs[s].T)
        return Batch(self.seed, meta, x.to(self.device), y0.to(self.device), ref)


def check(bank: Bank, b: Batch, y: torch.Tensor, band: float | None = None) -> None:
    """Adapter rows' slices within the dtype's band of float64; every other element bit for bit."""
    y, y0 = y.cpu(), b.y0.cpu()
    spec = bank.spec
    rows = b.meta.token_slot[: y.shape[0]].cpu() >= 0
    inside = torch.zeros(spec.y_width, dtype=torch.bool)
    for c, w in zip(spec.slice_starts, spec.out_dims, strict=True):
        inside[c : c + w] = True
    keep = ~(rows[:, None] & inside[None, :])  # [rows, y_width]: must be untouched
    bits = torch.int32 if y.dtype == torch.float32 else torch.int16
    changed = (y.view(bits) != y0.view(bits)) & keep
    if changed.any():
        t, c = changed.nonzero()[0].tolist()
        where = "a row without an adapter" if not rows[t] else "a column outside every slice"
        raise AssertionError(f"seed={bank.seed}: y[{t}, {c}] ({where}) changed from {y0[t, c]} to {y[t, c]}")
    got = y[rows][:, inside].double()
    want = b.ref[rows][:, inside]
    assert not torch.isnan(got).any(), f"seed={bank.seed}: NaN inside a slice (read poison?)"
    err = ((got - want).norm() / want.norm()).item()
    band = band or BAND[y.dtype]
    assert err < band, f"seed={bank.seed}: rel err {err:.2e} over {band:.0e}"
