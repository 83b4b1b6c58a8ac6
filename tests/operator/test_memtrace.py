"""The opt-in memory trace: off unless asked for; on SIGUSR1 it appends what grew and the live objects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from loraplane.operator import memtrace

# A process that installs the trace from its environment, then keeps a pod-shaped object per second alive.
PROGRAM = """
import sys, time
from loraplane.operator import memtrace
tracer = memtrace.install_from_env()
print("on" if tracer else "off", flush=True)
kept = []
while True:
    kept.append({"kind": "Pod", "metadata": {"name": "demo-x"}, "spec": {"n": [0] * 100}})
    time.sleep(0.05)
"""


def _run(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROGRAM], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip


def test_the_trace_is_off_without_its_variable():
    env = {k: v for k, v in os.environ.items() if k != memtrace.ENV}
    child = subprocess.run([sys.executable, "-c", PROGRAM.replace("while True", "while False")], env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert child.stdout.strip() == "off"


def test_sigusr1_appends_growth_and_the_live_objects(tmp_path):
    out = tmp_path / "trace.txt"
    child = _run({memtrace.ENV: str(out)})
    try:
        assert child.stdout.readline().strip() == "on"
        for _ in range(2):
            os.kill(child.pid, signal.SIGUSR1)
            time.sleep(1.0)
        deadline = time.monotonic() + 30
        while out.read_text().count("=== dump") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert child.poll() is None, "a dump must never stop the process"
    finally:
        child.kill()
        child.wait()
    text = out.read_text()
    assert text.count("=== dump") == 2 and "--- top growth since previous" in text
    assert "<string>:" in text.split("--- top growth since previous")[1], "the growing line is named"
    census = text.rsplit("--- live objects:", 1)[1]
    assert "Pod/demo-x" in census and "held by list" in census


def test_signals_during_a_dump_make_one_more_dump_never_a_second_at_once():
    """The handler only asks (it returns at once, however long a dump takes); asks that come during a dump are
    answered by one dump after it; two dumps never run at once."""
    started, release = threading.Event(), threading.Event()
    running, most = [0], [0]

    def slow_dump() -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        started.set()
        release.wait(10)
        running[0] -= 1

    dumper = memtrace.Dumper(slow_dump)
    dumper.request()
    assert started.wait(10), "the dump runs in the dumper's thread"
    asked = time.monotonic()
    for _ in range(3):  # SIGUSR1 thrice during the dump
        dumper.request()
    assert time.monotonic() - asked < 0.5, "a request never waits for the dump"
    release.set()
    deadline = time.monotonic() + 10
    while dumper.dumps < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a third dump would have started by now
    assert (dumper.dumps, dumper.merged, most[0]) == (2, 2, 1)


def test_a_dump_asked_for_during_another_writes_nothing(tmp_path):
    tracer = object.__new__(memtrace.Tracer)  # no tracemalloc.start in the test process: it slows everything
    tracer._dumping = threading.Lock()
    tracer.path = tmp_path / "trace.txt"
    with tracer._dumping:  # a dump under way
        assert tracer.dump() is False
    assert not tracer.path.exists()
