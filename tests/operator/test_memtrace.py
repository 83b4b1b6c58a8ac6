"""The opt-in memory trace: off unless asked for; on SIGUSR1 it appends what grew and the live objects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
