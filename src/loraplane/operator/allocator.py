"""The operator process's malloc policy: blocks of 128 KiB and more go back to the system when freed.

glibc serves such a block with an mmap of its own and unmaps it on free, but the first free of one raises
that threshold past the block's size (its "dynamic mmap threshold"). From then on the event loop's 256 KiB
blocks come from the heap: asyncio reads each socket into a fresh 256 KiB buffer, and every TLS connection to
the API server keeps one for its life. A replaced server pod brings a burst of them (every adapter loads onto
the new pod and posts an Event, kopf opening a connection per Event in flight), and small objects allocated
among them pin the heap's high-water mark: the operator's RSS rose a step of 0.1-2 MiB at every pod
replacement and never came down, although no Python object outlived the burst. With the threshold pinned,
those blocks are mapped and unmapped each time, and RSS follows the connections open at the moment.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LARGE_BLOCK = 128 * 1024  # glibc's default threshold, pinned: setting it turns the dynamic adjustment off
TRIM_AT = 128 * 1024  # free memory at the heap's top above this is returned (the default, unless raised)


def release_large_blocks() -> bool:
    """Pin glibc's mmap and trim thresholds. True when set; False where the C library has no ``mallopt``
    (musl answers 0, macOS has none): those allocators have no dynamic threshold to pin."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    pinned = mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_AT) == 1
    if not pinned:
        log.info("the C library's malloc has no mmap threshold to pin; large blocks stay as it places them")
    return pinned


TRIM_EVERY_S = 30.0  # a replaced pod's burst of loads and status writes settles in 10-20 s


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def trim_heaps(libc=None) -> bool:
    """Hand the free pages inside every malloc arena back to the system (``malloc_trim(0)``: glibc madvises
    them away, not only the top of each heap). False where the C library has no ``malloc_trim``."""
    libc = _libc() if libc is None else libc
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)  # ctypes lets go of the GIL for the call: the event loop goes on while glibc walks its arenas
    return True


class Trimmer:
    """Calls ``trim`` every ``every_s`` seconds on a daemon thread of its own until stopped."""

    def __init__(self, trim: Callable[[], object], every_s: float = TRIM_EVERY_S):
        if every_s <= 0:
            raise ValueError(f"every_s: must be positive, got {every_s}")
        self.trim = trim
        self.every_s = every_s
        self.runs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="malloc-trim", daemon=True)

    def start(self) -> Trimmer:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.trim()
            self.runs += 1

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def start_trimming(every_s: float = TRIM_EVERY_S, libc=None) -> Trimmer | None:
    """A running Trimmer of glibc's arenas; None (and nothing started) where the C library has no
    ``malloc_trim``."""
    libc = _libc() if libc is None else libc
    if getattr(libc, "malloc_trim", None) is None:
        return None
    return Trimmer(lambda: trim_heaps(libc), every_s).start()
