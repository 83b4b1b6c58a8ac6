"""Per-step batch metadata for the multi-LoRA ops, built once per step on the host.

Input: the step's requests in row order, ``[(slot or -1, num_tokens), ...]``; request i owns the next
``num_tokens`` rows of x. Output, in fixed-size device buffers (so a captured CUDA graph can replay
with new contents):

- ``token_slot``  [capacity] int32: adapter slot of each row, -1 for base-only rows (and past the end);
- ``token_order`` [capacity] int32: rows that carry an adapter, grouped by slot (stable);
- ``tiles``       [capacity, 3] int32: work tiles (slot, start in token_order, count <= tile_m); every
  tile holds tokens of one adapter, so one tile reads one adapter's A and B;
- ``num_tiles``   [1] int32.

Rows with slot -1 appear in no tile: they cost no work. Everything is computed from host data and sent
in one host-to-device copy (pinned, non-blocking on CUDA): nothing reads the device inside the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from loraplane.kernels.pool import check_max_rank, rank_error, resolve_device

__all__ = ["LoRABatchMeta"]


class LoRABatchMeta:
    """Reusable metadata buffers for batches of up to ``capacity`` tokens.

    ``capture=True`` marks buffers behind a CUDA graph: launch shapes then depend on the capacity and
    ``max_rank`` only, never on one step's contents; every batch built into them must then use adapters
    of rank <= ``max_rank`` (re-capture when a higher-rank adapter is loaded). A pool of rank-16
    adapters captured with ``max_rank=16`` gets 16-row tiles throughout.
    """

    __slots__ = (
        "capacity",
        "tile_m",
        "capture",
        "max_rank",
        "device",
        "_buf",
        "token_slot",
        "token_order",
        "tiles",
        "num_tiles",
        "_staging",
        "_events",
        "_flip",
        "num_tokens",
        "host_num_tiles",
        "host_max_rank",
        "groups",
        "plans",
        "scratch",
        "sync",
    )

    def __init__(
        self,
        capacity: int,
        device: torch.device | str = "cpu",
        *,
        tile_m: int = 16,
        capture: bool = False,
        max_rank: int = 128,
    ) -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if tile_m not in (16, 32, 64, 128):
            raise ValueError(f"tile_m must be one of 16, 32, 64, 128, got {tile_m!r}")
        check_max_rank("max_rank", max_rank)
        self.capacity, self.tile_m, self.capture, self.max_rank = capacity, tile_m, capture, max_rank
        self.device = resolve_device(device)
        n = self._buf_len()
        self._buf = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.token_slot, self.token_order, self.tiles, self.num_tiles = self._views(self._buf)
        pin = self.device.type == "cuda"
        self._staging = [torch.zeros(n, dtype=torch.int32, pin_memory=pin) for _ in range(2 if pin else 1)]
        self._events: list[torch.cuda.Event | None] = [None] * len(self._staging)
        self._flip = 0
        self.num_tokens = 0
        self.host_num_tiles = 0
        self.host_max_rank = 0
        # Host copy of the grouping for the torch path: [(slot, row indices int64 tensor)].
        self.groups: list[tuple[int, torch.Tensor]] = []
        # Launch shapes derived from this step's contents (ops.lora_apply), dropped at every build.
        self.plans: dict = {}
        # Shrink outputs of those launches, by shape: kept for the metadata's whole life (not dropped at
        # build) because a CUDA graph captured over this metadata keeps their addresses.
        self.scratch: dict[tuple, torch.Tensor] = {}
        # Per-tile-slot counters of the one-launch kernels (triton_fused), created on first use, zeros.
        self.sync: torch.Tensor | None = None

    def scratch_f32(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A float32 buffer of ``shape`` owned by this metadata, shared by every launch that asks for
        the same shape: they run one after another in stream order, each reading it before the next
        overwrites it."""
        key = (tuple(shape), str(device))
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = torch.empty(shape, dtype=torch.float32, device=device)
        return buf

    def sync_counters(self, device: torch.device) -> torch.Tensor:
        """int32 [capacity] counters, one per tile slot, for the one-launch kernels (triton_fused): each
        launch adds the same amount to every non-empty tile's counter, so they are never reset. Kept for
        the metadata's life, as the shrink buffers, since graphs keep their address."""
        if self.sync is None:
            self.sync = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        return self.sync

    def _buf_len(self) -> int:
        return self.capacity * 2 + self.capacity * 3 + 1

    def _views(self, buf: torch.Tensor):
        c = self.capacity
        token_slot = buf[:c]
        token_order = buf[c : 2 * c]
        tiles = buf[2 * c : 5 * c].view(c, 3)
        num_tiles = buf[5 * c : 5 * c + 1]
        return token_slot, token_order, tiles, num_tiles

    def build(self, requests: Sequence[tuple[int, int]], ranks: Sequence[int]) -> LoRABatchMeta:
        """Fill the buffers for one step. ``ranks[slot]`` is each slot's rank (``LoRAPool.host_ranks()``);
        a request naming a slot of rank 0 (free) is an error. Returns self."""
        slots_np, counts_np = _validate(requests, ranks, self.capacity)
        self.plans = {}
        total = int(counts_np.sum())
        token_slot = np.repeat(slots_np, counts_np).astype(np.int32)  # [total]
        rows = np.nonzero(token_slot >= 0)[0]
        order = rows[np.argsort(token_slot[rows], kind="stable")].astype(np.int32)  # [A] rows grouped by slot
        grouped = token_slot[order]
        bounds = np.flatnonzero(np.diff(grouped)) + 1 if order.size else np.zeros(0, np.int64)
        starts = np.concatenate([[0], bounds]).astype(np.int64) if order.size else np.zeros(0, np.int64)
        ends = (
            np.concatenate([bounds, [order.size]]).astype(np.int64) if order.size else np.zeros(0, np.int64)
        )
        tiles = [
            (int(grouped[s]), t0, min(self.tile_m, int(e) - t0))
            for s, e in zip(starts, ends, strict=True)
            for t0 in range(int(s), int(e), self.tile_m)
        ]
        self.groups = [
            (int(grouped[s]), torch.from_numpy(order[s:e].astype(np.int64)))
            for s, e in zip(starts, ends, strict=True)
        ]
        self.num_tokens, self.host_num_tiles = total, len(tiles)
        self.host_max_rank = max((int(ranks[g[0]]) for g in self.groups), default=0)
        if self.capture and self.host_max_rank > self.max_rank:
            raise ValueError(rank_error("requests (captured batch)", self.host_max_rank, self.max_rank))
        self._upload(token_slot, order, np.asarray(tiles, dtype=np.int32).reshape(-1, 3))
        return self

    def _upload(self, token_slot: np.ndarray, order: np.ndarray, tiles: np.ndarray) -> None:
        i = self._flip
        self._flip = (self._flip + 1) % len(self._staging)
        if self._events[i] is not None:
            self._events[i].synchronize()  # the copy from two steps ago; long done in practice
        stage = self._staging[i]
        slot_v, order_v, tiles_v, num_v = self._views(stage)
        slot_v.fill_(-1)
        slot_v[: token_slot.size] = torch.from_numpy(token_slot)
        order_v[: order.size] = torch.from_numpy(order)
        tiles_v.zero_()  # count 0 marks the unused tiles the kernels skip
        tiles_v[: tiles.shape[0]] = torch.from_numpy(tiles)
        num_v[0] = tiles.shape[0]
        if self.device.type == "cuda":
            self._buf.copy_(stage, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._events[i] = ev
        else:
            self._buf.copy_(stage)


def _validate(requests: Sequence[tuple[int, int]], ranks: Sequence[int], capacity: int):
    n_slots = len(ranks)
    slots, counts = [], []
    for i, req in enumerate(requests):
        try:
            slot, count = (int(v) for v in req)
        except (TypeError, ValueError):
            raise ValueError(f"requests[{i}] must be (slot, num_tokens), got {req!r}") from None
        if count < 0:
            raise ValueError(f"requests[{i}].num_tokens must be >= 0, got {count}")
        if slot != -1 and not (0 <= slot < n_slots and ranks[slot] > 0):
            raise ValueError(f"requests[{i}].slot {slot} is neither -1 nor an allocated adapter slot")
        slots.append(slot)
        counts.append(count)
    total = sum(counts)
    if total > capacity:
        raise ValueError(f"requests hold {total} tokens, over the metadata capacity {capacity}")
    return np.asarray(slots, dtype=np.int64), np.asarray(counts, dtype=np.int64)
