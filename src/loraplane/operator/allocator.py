"""The operator process's memory policy: reference cycles freed every few seconds; blocks of 128 KiB and more go back to the system when freed.

glibc serves such a block with an mmap of its own and unmaps it on free, but the first free of one raises
that threshold past the block's size (its "dynamic mmap threshold"). From then on the event loop's 256 KiB
blocks come from the heap: asyncio reads each socket into a fresh 256 KiB buffer, and every TLS connection to
the API server keeps one for its life. A replaced server pod brings a burst of them (every adapter loads onto
the new pod and posts an Event, kopf opening a connection per Event in flight), and small objects allocated
among them pin the heap's high-water mark: the operator's RSS rose a step of 0.1-2 MiB at every pod
replacement and never came down, although no Python object outlived the burst. With the threshold pinned,
those blocks are mapped and unmapped each time, and RSS follows the connections open at the moment.

The threads share two malloc arenas. glibc gives each thread that allocates an arena of its own, up to 8 per
core, and an arena keeps what its thread freed mapped for its next allocations: the operator's threads (the
reconcile calls', the Event lane's, kopf's) would each hold that slack. With 2
(``e2e/soak/memprobe.py``, 10 replacements of the one server Pod; ``e2e/soak/results/README.md``) RSS was
1.2-1.5 MiB lower from the start and stayed about 0.8 MiB lower after 10 replacements; the growth per
replacement after the second (0.08 and 0.11 MiB, against 0.12 without the cap) is within the spread between
runs. A periodic ``malloc_trim(0)`` (0.11) and ``PYTHONMALLOC=malloc`` (5 MiB more from the start) did no
better. What grows is mostly outside glibc's heaps (``/proc/PID/smaps``: in anonymous mappings of CPython's
1 MiB arena size), where no glibc setting reaches.

Those are CPython's own arenas, and what pins them is garbage that waits. A cycle (an asyncio task and its
future, an aiohttp response and its connection, an exception and its traceback) is freed only by a collection
of the generation that holds it, and the oldest generation is collected only when the objects promoted since
its last collection reach a quarter of those in it: with the operator's long-lived heap (kopf's indexes, the
caches), seldom. A burst's cycles then outlive many bursts, each new burst's objects go into fresh pools
around them, and the survivors among those keep the pages resident once the cycles are gone. Tracing showed
the heap going up and down by 6 MiB between replacements while nothing lived on. A full collection every
``COLLECT_EVERY_S`` frees each burst's cycles before the next burst, which then reuses their pools.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import threading
import time

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
LARGE_BLOCK = 128 * 1024  # glibc's default threshold, pinned: setting it turns the dynamic adjustment off
TRIM_AT = 128 * 1024  # free memory at the heap's top above this is returned (the default, unless raised)
COLLECT_EVERY_S = 15.0  # about a Pod replacement's burst; a full pass takes tens of milliseconds
ARENAS = 2  # glibc's default is 8 per core; the operator's 30 threads would each come to have one


def cap_arenas(arenas: int = ARENAS, libc=None) -> bool:
    """At most ``arenas`` malloc arenas for the process's threads; call before threads start (an arena
    made already stays). True when set; False where the C library has no ``mallopt`` or no such parameter
    (musl answers 0)."""
    if arenas < 1:
        raise ValueError(f"arenas: must be at least 1, got {arenas}")
    mallopt = getattr(_libc() if libc is None else libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_ARENA_MAX, arenas) == 1


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def release_large_blocks(libc=None) -> bool:
    """Pin glibc's mmap and trim thresholds. True when set; False where the C library has no ``mallopt``
    (musl answers 0, macOS has none): those allocators have no dynamic threshold to pin."""
    mallopt = getattr(_libc() if libc is None else libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    pinned = mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_AT) == 1
    if not pinned:
        log.info("the C library's malloc has no mmap threshold to pin; large blocks stay as it places them")
    return pinned


def collect_cycles_every(
    seconds: float = COLLECT_EVERY_S, stop: threading.Event | None = None
) -> threading.Thread:
    """Start a daemon thread that runs a full garbage collection every ``seconds`` until ``stop`` is set."""
    if not 0 < seconds < math.inf:
        raise ValueError(f"seconds: must be > 0 and finite, got {seconds}")
    stop = stop or threading.Event()

    def collect() -> None:
        while not stop.wait(seconds):
            started = time.perf_counter()
            freed = gc.collect()
            log.debug(
                "full collection: %d objects freed in %.1f ms", freed, 1e3 * (time.perf_counter() - started)
            )

    thread = threading.Thread(target=collect, name="gc-every", daemon=True)
    thread.start()
    return thread
