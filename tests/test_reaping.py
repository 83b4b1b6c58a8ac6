"""The tests' child processes die with the test session (tests/reaping.py), even one killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.reaping import reaped

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# A stand-in for the test session: it starts a long sleep through reaped() and prints the sleep's pid.
SESSION = (
    "import subprocess, sys, time\n"
    "from tests.reaping import reaped\n"
    "child = subprocess.Popen(reaped(['sleep', '600']))\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _command(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().split(b"\0")[0]
    except FileNotFoundError:
        return b""


def test_a_child_started_through_reaped_dies_when_the_session_is_killed():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    session = subprocess.Popen([sys.executable, "-c", SESSION], stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        pid = int(session.stdout.readline())
        deadline = time.monotonic() + 10
        while _command(pid) != b"sleep" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _command(pid) == b"sleep"  # the launcher exec'd into the command, keeping its pid
        session.send_signal(signal.SIGKILL)
        session.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the child outlived the session that started it"
    finally:
        session.kill()
        session.wait(10)


def test_the_command_runs_with_its_arguments_and_exit_status():
    done = subprocess.run(reaped([sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(3)", "a b"]),
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 3 and done.stdout.strip() == "['a b']"
