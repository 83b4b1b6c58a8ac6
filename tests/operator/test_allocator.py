"""The operator's malloc policy: a 256 KiB block (asyncio's read buffer, a TLS connection's buffer) is mapped on
its own and unmapped when freed, every time, not only until glibc has seen the first one freed."""

from __future__ import annotations

import itertools
import pathlib
import platform
import subprocess
import sys
import threading
import time

import pytest

from loraplane.operator.allocator import Trimmer, start_trimming, trim_heaps

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


class NoTrim:
    """A C library without ``malloc_trim`` (musl, macOS): nothing to call."""


def test_trim_heaps_is_false_on_a_libc_without_malloc_trim():
    assert not trim_heaps(NoTrim())


def test_no_trimmer_starts_on_a_libc_without_malloc_trim():
    assert start_trimming(0.01, libc=NoTrim()) is None


@glibc
def test_trim_heaps_calls_glibcs_malloc_trim():
    assert trim_heaps()


# In a fresh interpreter: a heap with free pages in its middle (every other 64 KiB block of 1000 freed, a live
# one after each, so none of it is at the heap's top), RSS in KiB before and after one trim_heaps().
TRIM_PROBE = """
import sys
from pathlib import Path
from loraplane.operator.allocator import release_large_blocks, trim_heaps

def rss_kib():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssAnon:"))
    return int(line.split()[1])

release_large_blocks()
blocks = [bytearray(64 * 1024) for _ in range(1000)]
del blocks[::2]
before = rss_kib()
assert trim_heaps()
print(before - rss_kib())
"""


@glibc
def test_trim_heaps_returns_free_pages_from_the_middle_of_the_heap():
    """500 free 64 KiB holes between live blocks: glibc's own trim (top of the heap only) keeps them all."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], env=env, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert int(out.stdout.strip()) > 20 * 1024  # KiB: most of the 31 MiB of holes


def test_trimmer_trims_on_its_schedule_and_stops():
    calls = []
    ran = threading.Event()

    def trim():
        calls.append(time.monotonic())
        if len(calls) == 3:
            ran.set()

    began = time.monotonic()
    trimmer = Trimmer(trim, every_s=0.05).start()
    assert ran.wait(5), "three trims within 5 s"
    trimmer.stop()
    assert not trimmer.running
    assert calls[0] - began >= 0.05  # the first trim waits a period: startup's allocations are not a burst
    assert all(b - a >= 0.04 for a, b in itertools.pairwise(calls))
    stopped = len(calls)
    time.sleep(0.2)
    assert len(calls) == stopped  # no trim after stop


def test_trimmer_stops_at_once_between_trims():
    trimmer = Trimmer(lambda: None, every_s=3600).start()
    began = time.monotonic()
    trimmer.stop()
    assert not trimmer.running and time.monotonic() - began < 1
    assert trimmer.runs == 0


def test_trimmer_rejects_a_period_that_is_not_positive():
    with pytest.raises(ValueError, match="every_s"):
        Trimmer(lambda: None, every_s=0)
