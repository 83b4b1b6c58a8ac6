"""One page-locked arena for the host tier, locked once when the engine starts and carved per adapter.

Page-locking memory (``cudaHostAlloc``, behind ``pin_memory=True``) takes a lock in the CUDA driver that the
engine thread's kernel launches also need, for milliseconds per hundred megabytes: a load that pins its own
buffer stalls decoding while it pins. The arena is locked once (``cudaHostRegister``, exactly its size, where
the caching host allocator would round a request up to a power of two), then every parsed adapter takes a
contiguous block of it: first fit over a free list sorted by offset, neighbours merged on free.

A block returns to the arena when the last tensor that shares its memory dies (the block's numpy view is
what every such tensor's storage keeps alive), so a host-to-device copy still reading it, or an entry
evicted from the host tier while a copy is in flight, can never see its bytes reused.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

ALIGN = 4096  # blocks start on a page: O_DIRECT-friendly, and every dtype's alignment


class PinnedArena:
    def __init__(self, nbytes: int, *, pin: bool) -> None:
        """``pin``: page-lock the arena (CUDA hosts); False gives the same allocator over pageable memory."""
        if nbytes < ALIGN:
            raise ValueError(f"nbytes: the arena needs at least {ALIGN} bytes, got {nbytes}")
        self.capacity = nbytes - nbytes % ALIGN
        self._unlock: weakref.finalize | None = None  # set when cudaHostRegister locked it
        if pin:
            self._mem, self.pinned, self._unlock = _page_locked(self.capacity)
        else:
            self._mem, self.pinned = np.empty(self.capacity, dtype=np.uint8), False
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted by offset
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of ``nbytes`` in the arena, or None when no free run is that long."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            for i, (offset, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, length - size)
                    self.used += size
                    break
            else:
                return None
        block = self._mem[offset : offset + size]
        weakref.finalize(block, self._give, offset, size)  # when the last tensor on it dies
        return torch.from_numpy(block)[:nbytes]

    def _give(self, offset: int, size: int) -> None:
        with self._lock:
            self.used -= size
            i = bisect.bisect(self._free, (offset, size))
            self._free.insert(i, (offset, size))
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:  # merge the next run
                size += self._free.pop(i + 1)[1]
                self._free[i] = (offset, size)
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # merge the previous run
                prev = self._free.pop(i - 1)
                self._free[i - 1] = (prev[0], prev[1] + size)

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max((length for _, length in self._free), default=0)

    def close(self) -> None:
        """Unlock the arena's pages now where this arena locked them (blocks still alive keep the memory).
        Without it they are unlocked when the memory itself goes (see ``_page_locked``)."""
        if self._unlock is not None:
            self._unlock()
            self._unlock, self.pinned = None, False


def take_or_evict(
    arena: PinnedArena, nbytes: int, evict_one: Callable[[], bool], wait_s: float
) -> torch.Tensor | None:
    """A block of ``nbytes``, calling ``evict_one`` (drop the least-recently-used host entry nothing needs;
    False when there is none) until a run that long is free. A dropped entry's block comes back only once no
    copy reads it, so this waits up to ``wait_s`` for copies in flight; None past that, or when ``nbytes``
    exceeds the arena."""
    deadline = time.monotonic() + wait_s
    while nbytes <= arena.capacity:
        block = arena.take(nbytes)
        if block is not None:
            return block
        if evict_one():
            continue
        if time.monotonic() > deadline:
            break
        time.sleep(0.002)
    return None


def _unregister(address: int) -> None:
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostUnregister(address)) != 0:
        cudart.cudaGetLastError()  # not a later kernel's error (see below)


def _page_locked(nbytes: int) -> tuple[np.ndarray, bool, weakref.finalize | None]:
    """``nbytes`` of page-locked memory: an anonymous map (page-aligned) locked in place with exactly its
    size, else (the driver refuses) one page-locked allocation of torch's; pageable when neither works."""
    cudart = torch.cuda.cudart()
    try:
        mem = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    except OSError as exc:  # more than the host will ever give: say which setting asked for it
        raise ValueError(f"lora_host_bytes: cannot reserve {nbytes} bytes of host memory for the host tier "
                         f"({exc.strerror}); set it below the host's free memory") from exc  # fmt: skip
    err = int(cudart.cudaHostRegister(mem.ctypes.data, nbytes, 0))
    if err == 0:
        # Unlock before the map goes (every block is a view of ``mem``, so this runs after the last one):
        # a range unmapped while still registered makes the next map at that address fail to register.
        unlock = weakref.finalize(mem, _unregister, mem.ctypes.data)
        unlock.atexit = False  # the process's exit unlocks everything, after CUDA may already be gone
        if torch.from_numpy(mem[:ALIGN]).is_pinned():
            return mem, True, unlock
        unlock()
    else:
        # A failed runtime call leaves its error for the next kernel launch to report as its own.
        cudart.cudaGetLastError()
    try:
        held = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return mem, False, None
    return held.numpy(), held.is_pinned(), None  # the numpy view keeps the tensor (and its memory) alive
