"""Random multi-LoRA problems and their float64 reference, shared by the kernel tests.

Every problem draws fresh random data (its seed is in ``case.seed`` for the failure message). Pool rows
that no active adapter owns, the tail rows of partly used pages, and the x and y rows of tokens without
an adapter are NaN: a kernel that reads outside its adapter's rank or touches a base-only row fails.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from loraplane.kernels import LoRABatchMeta, LoRAPool, ModuleSpec, lora_scale

MODULES = {
    "q": ModuleSpec(96, (64,)),
    "qkv": ModuleSpec(64, (32, 16, 16)),
    "gate_up": ModuleSpec(64, (48, 48)),
    "down": ModuleSpec(160, (32,)),
}


@dataclass(slots=True)
class Case:
    seed: int
    pool: LoRAPool
    meta: LoRABatchMeta
    module: str
    x: torch.Tensor  # [T, in_dim]
    y0: torch.Tensor  # [T, out_total]
    ref: torch.Tensor  # [T, out_total] float64
    v_ref: torch.Tensor  # [S, T, max_rank] float64, 0 where unused
    dense: dict = field(default_factory=dict)  # slot -> (rank, scale, [A_s], [B_s])

    def adapter_rows(self) -> torch.Tensor:
        return self.meta.token_slot[: self.x.shape[0]].cpu() >= 0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_case(
    *,
    num_tokens: int,
    num_adapters: int,
    ranks: tuple[int, ...],
    module: str = "qkv",
    no_adapter_frac: float = 0.2,
    tokens_per_request: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tile_m: int = 16,
    capture: bool = False,
    capacity: int | None = None,
    resident_extra: int = 2,
    max_rank: int = 128,
) -> Case:
    seed = secrets.randbits(31)
    g = torch.Generator().manual_seed(seed)
    spec = MODULES[module]
    pool = LoRAPool(MODULES, 1, 64 << 20, page_rank=8, max_rank=128, dtype=dtype, device=device)
    dense = {}
    resident = []
    # Idle residents before and after the active ones: their pages hold NaN and must never be read.
    for i in range(num_adapters + resident_extra):
        r = ranks[i % len(ranks)]
        use_rslora = i % 2 == 1
        slot = pool.allocate(r, lora_scale(2.0 * r, r, use_rslora) / 2)
        As = [torch.randn(r, spec.in_dim, generator=g) / spec.in_dim**0.5 for _ in spec.out_dims]
        Bs = [torch.randn(w, r, generator=g) / r**0.5 for w in spec.out_dims]
        for s in range(spec.num_slices):
            pool.write(slot, 0, module, s, As[s], Bs[s])
        resident.append(slot)
        dense[slot] = (
            r,
            pool.scale_of(slot),
            [a.to(dtype).double() for a in As],
            [b.to(dtype).double() for b in Bs],
        )
    active = resident[resident_extra // 2 : resident_extra // 2 + num_adapters]
    _poison_unowned(pool, set(active))
    requests, t, i = [], 0, 0
    while t < num_tokens:
        n = min(tokens_per_request, num_tokens - t)
        base_only = torch.rand((), generator=g).item() < no_adapter_frac and (t > 0 or no_adapter_frac >= 1)
        requests.append((-1 if base_only else active[i % len(active)], n))
        i += 0 if base_only else 1
        t += n
    cap = capacity or num_tokens
    meta = LoRABatchMeta(cap, device, tile_m=tile_m, capture=capture, max_rank=max_rank)
    meta.build(requests, pool.host_ranks())
    rows = cap if capture else num_tokens
    x = torch.randn(rows, spec.in_dim, generator=g).to(dtype)
    y0 = torch.randn(rows, spec.out_total, generator=g).to(dtype)
    token_slot = meta.token_slot[:rows].cpu()
    x[token_slot < 0] = float("nan")
    y0[token_slot < 0] = float("nan")
    ref = y0.double().clone()
    v_ref = torch.zeros(spec.num_slices, rows, 128, dtype=torch.float64)
    starts = spec.out_starts
    for t_i, slot in enumerate(token_slot.tolist()):
        if slot < 0:
            continue
        r, scale, As, Bs = dense[slot]
        for s in range(spec.num_slices):
            v = x[t_i].double() @ As[s].T
            v_ref[s, t_i, :r] = v
            ref[t_i, starts[s] : starts[s + 1]] += scale * (v @ Bs[s].T)
    return Case(seed, pool, meta, module, x.to(device), y0.to(device), ref, v_ref, dense)


def _poison_unowned(pool: LoRAPool, active: set[int]) -> None:
    owned = torch.zeros(pool.num_pages * pool.page_rank, dtype=torch.bool)
    for slot in active:
        owned[pool.rows_of(slot).cpu()] = True
    for buf in (*pool.a.values(), *pool.bt.values()):
        if buf.dim() == 3:
            buf[:, ~owned.to(buf.device)] = float("nan")
        else:
            buf[~owned.to(buf.device)] = float("nan")
