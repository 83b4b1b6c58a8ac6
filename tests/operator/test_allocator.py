"""The operator's malloc policy: a 256 KiB block (asyncio's read buffer, a TLS connection's buffer) is mapped on
its own and unmapped when freed, every time, not only until glibc has seen the first one freed."""

from __future__ import annotations

import pathlib
import platform
import subprocess
import sys

import pytest

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
