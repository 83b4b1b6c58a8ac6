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

import math
from collections.abc import Sequence

import numpy as np
import torch

from loraplane.kernels.module_spec import check_max_rank, rank_error
from loraplane.kernels.pool import resolve_device

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
        "_staging_np",
        "_events",
        "_flip",
        "num_tokens",
        "host_num_tiles",
        "host_max_rank",
        "_groups",
        "_order",
        "_bounds",
        "plans",
        "scratch",
        "_flat",
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
        # numpy views of the staging buffers: a step's fill is a few slice assignments, not torch calls
        self._staging_np = [stage.numpy() for stage in self._staging]
        self._events: list[torch.cuda.Event | None] = [None] * len(self._staging)
        self._flip = 0
        self.num_tokens = 0
        self.host_num_tiles = 0
        self.host_max_rank = 0
        # The step's grouping on the host (rows grouped by slot, and each group's [start, end) in them);
        # ``groups`` turns it into tensors only when the torch path asks.
        self._order = np.zeros(0, np.int32)
        self._bounds = (np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._groups: list[tuple[int, torch.Tensor]] | None = []
        # Launch shapes derived from this step's contents (ops.lora_apply), dropped at every build.
        self.plans: dict = {}
        # Shrink outputs of those launches, by shape: kept for the metadata's whole life (not dropped at
        # build) because a CUDA graph captured over this metadata keeps their addresses.
        self.scratch: dict[tuple, torch.Tensor] = {}
        self._flat: torch.Tensor | None = None  # the eager (not captured) launches' one shrink buffer
        # Per-tile-slot counters of the one-launch kernels (triton_fused), created on first use, zeros.
        self.sync: torch.Tensor | None = None

    def scratch_f32(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A float32 buffer of ``shape`` owned by this metadata, shared by every launch that asks for
        the same shape: they run one after another in stream order, each reading it before the next
        overwrites it.

        Eager metadata (not captured) serves a different token count every step, and a buffer per shape
        would keep one for every count ever seen, without bound. Its launches share one flat buffer instead,
        grown to the largest asked for (at most split x slices x capacity x max rank), each taking a view
        of its front: in stream order each shrink's output is read by its expand before the next shrink."""
        if not self.capture:
            n = math.prod(shape)
            if self._flat is None or self._flat.numel() < n or self._flat.device != torch.device(device):
                self._flat = torch.empty(n, dtype=torch.float32, device=device)
            return self._flat[:n].view(shape)
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

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """Host copy of the grouping for the torch path: [(slot, row indices int64 tensor)], in slot order."""
        if self._groups is None:
            order, (slots, starts, ends) = self._order, self._bounds
            self._groups = [
                (slot, torch.from_numpy(order[s:e].astype(np.int64)))
                for slot, s, e in zip(slots.tolist(), starts.tolist(), ends.tolist(), strict=True)
            ]
        return self._groups

    def rows_with_adapter(self) -> int:
        """How many of the step's rows carry an adapter."""
        return int(self._order.size)

    def step_slots(self) -> list[int]:
        """The distinct adapter slots of the step, ascending."""
        return self._bounds[0].tolist()

    def build(self, requests: Sequence[tuple[int, int]], ranks: Sequence[int]) -> LoRABatchMeta:
        """Fill the buffers for one step. ``ranks[slot]`` is each slot's rank (``LoRAPool.host_ranks()``);
        a request naming a slot of rank 0 (free) is an error. Returns self.

        All numpy, no per-token or per-group Python: this runs on the host before every step's launches,
        and with 64 distinct adapters a loop per group cost more than the step's smaller kernels."""
        slots_np, counts_np = _validate(requests, ranks, self.capacity)
        self.plans = {}
        token_slot = np.repeat(slots_np, counts_np).astype(np.int32)  # [total]
        rows = np.flatnonzero(token_slot >= 0)
        order = rows[np.argsort(token_slot[rows], kind="stable")].astype(np.int32)  # [A] rows grouped by slot
        grouped = token_slot[order]  # [A] slot of each grouped row
        starts = np.flatnonzero(np.diff(grouped, prepend=-1))  # [G] first position of each slot's group
        ends = np.append(starts[1:], order.size) if starts.size else starts  # [G]
        tiles = _tiles(grouped, starts, ends, self.tile_m)  # [n, 3] (slot, start, count)
        group_slots = grouped[starts]  # [G]
        self._order, self._bounds, self._groups = order, (group_slots, starts, ends), None
        self.num_tokens, self.host_num_tiles = int(counts_np.sum()), int(tiles.shape[0])
        self.host_max_rank = max((int(ranks[g]) for g in group_slots.tolist()), default=0)
        if self.capture and self.host_max_rank > self.max_rank:
            raise ValueError(rank_error("requests (captured batch)", self.host_max_rank, self.max_rank))
        self._upload(token_slot, order, tiles)
        return self

    def _upload(self, token_slot: np.ndarray, order: np.ndarray, tiles: np.ndarray) -> None:
        i = self._flip
        self._flip = (self._flip + 1) % len(self._staging)
        if self._events[i] is not None:
            self._events[i].synchronize()  # the copy from two steps ago; long done in practice
        stage, c = self._staging_np[i], self.capacity  # the layout of _views
        stage[:c] = -1
        stage[: token_slot.size] = token_slot
        stage[c : c + order.size] = order
        stage[2 * c : 5 * c] = 0  # count 0 marks the unused tiles the kernels skip
        stage[2 * c : 2 * c + tiles.size] = tiles.ravel()
        stage[5 * c] = tiles.shape[0]
        if self.device.type == "cuda":
            self._buf.copy_(self._staging[i], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._events[i] = ev
        else:
            self._buf.copy_(self._staging[i])


def _tiles(grouped: np.ndarray, starts: np.ndarray, ends: np.ndarray, tile_m: int) -> np.ndarray:
    """int32 [n, 3] work tiles (slot, start in token_order, count <= tile_m): each group of one slot cut
    into runs of tile_m rows."""
    sizes = ends - starts  # [G]
    if not (sizes > tile_m).any():  # decode: every group fits one tile
        return np.stack([grouped[starts], starts, sizes], axis=1).astype(np.int32).reshape(-1, 3)
    per = -(-sizes // tile_m)  # [G] tiles per group
    first = np.repeat(starts, per)  # [n] the group's start, per tile
    k = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)  # [n] tile index in its group
    t0 = first + k * tile_m
    count = np.minimum(tile_m, np.repeat(ends, per) - t0)
    return np.stack([grouped[t0], t0, count], axis=1).astype(np.int32).reshape(-1, 3)


def _validate(requests: Sequence[tuple[int, int]], ranks: Sequence[int], capacity: int):
    """(slots, counts) int64 [n] each. One numpy conversion for well-formed requests; anything odd (or
    wrong) goes through the per-request checks, which name the first bad request."""
    pairs = _as_pairs(requests)
    if pairs is None or not _pairs_ok(pairs, ranks):
        pairs = _checked_pairs(requests, ranks)
    total = int(pairs[:, 1].sum())
    if total > capacity:
        raise ValueError(f"requests hold {total} tokens, over the metadata capacity {capacity}")
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def _as_pairs(requests: Sequence[tuple[int, int]]) -> np.ndarray | None:
    """int64 [n, 2] of plain int pairs; None for anything else."""
    try:
        pairs = np.asarray(requests, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return None
    if pairs.size == 0:
        return pairs.reshape(0, 2)
    return pairs if pairs.ndim == 2 and pairs.shape[1] == 2 else None


def _pairs_ok(pairs: np.ndarray, ranks: Sequence[int]) -> bool:
    if (pairs[:, 1] < 0).any():
        return False
    n = len(ranks)
    # distinct slots: at most one per adapter of the step
    return all(s == -1 or (0 <= s < n and ranks[s] > 0) for s in set(pairs[:, 0].tolist()))


def _checked_pairs(requests: Sequence[tuple[int, int]], ranks: Sequence[int]) -> np.ndarray:
    n_slots = len(ranks)
    pairs = []
    for i, req in enumerate(requests):
        try:
            slot, count = (int(v) for v in req)
        except (TypeError, ValueError):
            raise ValueError(f"requests[{i}] must be (slot, num_tokens), got {req!r}") from None
        if count < 0:
            raise ValueError(f"requests[{i}].num_tokens must be >= 0, got {count}")
        if slot != -1 and not (0 <= slot < n_slots and ranks[slot] > 0):
            raise ValueError(f"requests[{i}].slot {slot} is neither -1 nor an allocated adapter slot")
        pairs.append((slot, count))
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
