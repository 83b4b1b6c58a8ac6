"""Stack dumps for tensor-parallel tests on GPUs: a group that hangs shows where, on every rank."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import threading
from contextlib import contextmanager


@contextmanager
def stacks_after(seconds: float):
    """After ``seconds``: this process's stacks, then SIGUSR1 to its tensor-parallel workers (they print
    theirs, see parallel/launch.py), during startup too. Nothing happens if the block ends first."""

    def dump() -> None:
        print(f"--- still running after {seconds} s: stacks of every rank ---", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for child in mp.active_children():
            if child.name.startswith("loraplane-tp-rank") and child.pid is not None:
                os.kill(child.pid, signal.SIGUSR1)

    timer = threading.Timer(seconds, dump)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
