"""``loraplane serve --tensor-parallel-size 2`` on CPU: one HTTP front on rank 0, one worker process, greedy
completions, and no process left after SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(") ", 1)[-1].startswith("Z")


def test_serve_splits_the_base_over_two_processes(tiny_chat_model_dir):
    port = _free_port()
    argv = ["serve", "--model", str(tiny_chat_model_dir), "--device", "cpu", "--dtype", "float32",
            "--max-model-len", "64", "--num-kv-blocks", "16", "--port", str(port), "--tensor-parallel-size", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = "import sys, torch; torch.set_num_threads(1); from loraplane.cli import main; sys.exit(main())"
    server = subprocess.Popen([sys.executable, "-c", code, *argv], env=env)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, f"serve exited with {server.returncode}"
            assert time.monotonic() < deadline, "serve did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        # spawned ranks run multiprocessing's spawn_main (the resource tracker is another child)
        workers = [p for p in _children(server.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(workers) == 1, f"expected one worker process, found children {_children(server.pid)}"
        body = {"model": tiny_chat_model_dir.name, "prompt": "hello", "max_tokens": 6, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 6
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its shutdown
        deadline = time.monotonic() + 30
        while not all(map(_gone, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(map(_gone, workers)), "a tensor-parallel worker outlived the server"
    finally:
        server.kill()
        server.wait(30)
        for pid in workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
