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
