"""The operator's malloc policy: a 256 KiB block (asyncio's read buffer, a TLS connection's buffer) is mapped on
its own and unmapped when freed, every time, not only until glibc has seen the first one freed; the threads
share two malloc arenas."""

from __future__ import annotations

import pathlib
import platform
import subprocess
import sys
import time

import pytest

from loraplane.operator.allocator import cap_arenas, release_large_blocks

ROOT = pathlib.Path(__file__).resolve().parents[2]

# In a fresh interpreter: free one 256 KiB block (glibc then raises its mmap threshold past that size unless
# it is pinned), then count the chunks glibc has mapped on their own (mallinfo2().hblks) while a second one
# lives. 1: the block has its own mapping and goes back to the system when freed; 0: it came from the heap.
PROBE = """
import ctypes, sys
from loraplane.operator.allocator import release_large_blocks

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "pinned":
    assert release_large_blocks()
BLOCK = 256 * 1024  # asyncio's max_size: what each socket read and each TLS connection's buffer allocates
del_me = bytearray(BLOCK)
del del_me
before = libc.mallinfo2().hblks
block = bytearray(BLOCK)
print(libc.mallinfo2().hblks - before)
"""

glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or sys.platform != "linux", reason="glibc's malloc policy"
)


def mapped_on_its_own(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    return int(out.stdout.strip())


@glibc
def test_large_blocks_stay_out_of_the_heap_after_the_first_is_freed():
    assert mapped_on_its_own("pinned") == 1


@glibc
def test_without_the_policy_glibc_moves_them_into_the_heap():
    """The behaviour the policy exists for (the probe above can fail): after one 256 KiB block is freed, the
    next comes from the heap, where a burst of them raises a high-water mark that small objects then pin."""
    assert mapped_on_its_own("default") == 0


class NoMallopt:
    """A C library without ``mallopt`` (macOS): nothing to set."""


def test_without_mallopt_nothing_is_set():
    assert not cap_arenas(libc=NoMallopt())
    assert not release_large_blocks(libc=NoMallopt())


def test_cap_arenas_rejects_fewer_than_one():
    with pytest.raises(ValueError, match="arenas"):
        cap_arenas(0)


# In a fresh interpreter: 8 threads alive at once, each holding blocks from glibc's malloc (over 512 B, past
# Python's own allocator); malloc_stats() then prints one "Arena N:" line per arena, to stderr.
ARENAS_PROBE = """
import ctypes, os, sys, threading
from loraplane.operator.allocator import cap_arenas

if sys.argv[1] == "capped":
    assert cap_arenas(2)
THREADS = 8
barrier = threading.Barrier(THREADS + 1)
held = []

def work():
    held.append([bytearray(4096) for _ in range(64)])
    barrier.wait()  # all alive, each with its blocks
    barrier.wait()  # counted

threads = [threading.Thread(target=work) for _ in range(THREADS)]
for t in threads:
    t.start()
barrier.wait()
ctypes.CDLL(None).malloc_stats()
barrier.wait()
for t in threads:
    t.join()
"""


def arenas(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", ARENAS_PROBE, mode], env=env, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    return sum(line.startswith("Arena ") for line in out.stderr.splitlines())


@glibc
def test_threads_share_the_capped_arenas():
    assert arenas("capped") == 2


@glibc
def test_without_the_cap_each_thread_gets_an_arena():
    """What the cap is for (the probe above can fail): glibc gives threads up to 8 arenas per core."""
    assert arenas("default") > 2


class _Node:
    """A self-referencing object: freed only by a garbage collection, never by reference counting."""

    def __init__(self):
        self.me = self


def test_the_collector_frees_a_cycle_that_pythons_own_collections_left():
    import gc
    import threading
    import weakref

    from loraplane.operator.allocator import collect_cycles_every

    stop = threading.Event()
    gc.disable()  # stands in for the oldest generation's rare collections
    try:
        node = _Node()
        alive = weakref.ref(node)
        del node
        assert alive() is not None  # garbage, still allocated
        thread = collect_cycles_every(0.05, stop)
        deadline = time.monotonic() + 5
        while alive() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alive() is None
    finally:
        stop.set()
        gc.enable()
    thread.join(timeout=5)
    assert not thread.is_alive()


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf")])
def test_the_collector_refuses_a_period_that_is_not_positive_and_finite(seconds):
    from loraplane.operator.allocator import collect_cycles_every

    with pytest.raises(ValueError, match="seconds"):
        collect_cycles_every(seconds)
