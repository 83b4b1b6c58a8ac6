"""The usage log of a real ``loraplane serve`` process killed with SIGKILL under load: every request whose answer
completed has its line, only requests in flight may lack one, and a restarted server appends to the same log
and serves it at ``GET /admin/usage``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import loraplane

pytestmark = pytest.mark.timeout(400)

CLIENTS = 6
TOKEN = "admin-token-kill-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """``loraplane serve`` in a child process, with a usage log and an admin port."""

    def __init__(self, model_dir: Path, log_dir: Path, token_file: Path) -> None:
        self.port, self.admin_port = _free_port(), _free_port()
        argv = ["serve", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
                "--num-kv-blocks", "32", "--port", str(self.port), "--admin-port", str(self.admin_port),
                "--admin-token-file", str(token_file), "--usage-log-dir", str(log_dir), "--log-level", "warning"]  # fmt: skip
        src = str(Path(loraplane.__file__).parents[1])  # this checkout's sources, whatever the cwd
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
        }
        code = "import sys, torch; torch.set_num_threads(1); from loraplane.cli import main; sys.exit(main())"
        self.process = subprocess.Popen([sys.executable, "-c", code, *argv], env=env)
        self.url, self.model = f"http://127.0.0.1:{self.port}", model_dir.name

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 180
        while True:
            assert self.process.poll() is None, f"serve exited with {self.process.returncode}"
            assert time.monotonic() < deadline, "serve did not become ready"
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


def _client(server: Serve, index: int, completed: list[str], stop: threading.Event) -> None:
    """Requests one after another; an answer counts as completed once it was read whole (or to [DONE])."""
    n = 0
    with httpx.Client(base_url=server.url, timeout=60) as client:
        while not stop.is_set():
            n += 1
            body = {
                "model": server.model,
                "prompt": f"tell me {index} {n}",
                "max_tokens": 2 + n % 4,
                "seed": n,
            }
            try:
                if n % 2:
                    reply = client.post("/v1/completions", json=body)
                    if reply.status_code == 200:
                        completed.append(reply.json()["id"])
                    continue
                with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
                    answer_id = None
                    for line in reply.iter_lines():
                        if line.startswith("data: {"):
                            answer_id = json.loads(line[6:])["id"]
                        elif line == "data: [DONE]":
                            completed.append(answer_id)
            except httpx.TransportError:
                return  # the server is gone


def _log_ids(log_dir: Path) -> list[str]:
    lines = b"".join(p.read_bytes() for p in sorted(log_dir.glob("usage-*.jsonl"))).split(b"\n")
    return [json.loads(line)["id"] for line in lines if line.strip()]


def test_a_killed_server_loses_only_the_lines_of_requests_in_flight(tiny_chat_model_dir, tmp_path):
    log_dir, token_file = tmp_path / "usage", tmp_path / "admin-token"
    token_file.write_text(TOKEN)
    server = Serve(tiny_chat_model_dir, log_dir, token_file)
    completed: list[str] = []
    stop = threading.Event()
    try:
        server.wait_ready()
        clients = [
            threading.Thread(target=_client, args=(server, i, completed, stop)) for i in range(CLIENTS)
        ]
        for thread in clients:
            thread.start()
        deadline = time.monotonic() + 120
        while len(completed) < 80 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(server.process.pid, signal.SIGKILL)  # mid-run: requests are in flight
        stop.set()
        for thread in clients:
            thread.join(60)
    finally:
        server.stop()
    assert len(completed) >= 80, "the clients did not get going"
    logged = _log_ids(log_dir)
    assert len(logged) == len(set(logged))
    missing = set(completed) - set(logged)
    assert not missing, f"{len(missing)} completed requests lost their usage line"
    assert len(logged) - len(completed) <= CLIENTS  # a line may precede its answer's last bytes, no more

    again = Serve(tiny_chat_model_dir, log_dir, token_file)
    try:
        again.wait_ready()
        body = {"model": again.model, "prompt": "after the restart", "max_tokens": 3}
        answer = httpx.post(f"{again.url}/v1/completions", json=body, timeout=60).json()
        usage = httpx.get(f"http://127.0.0.1:{again.admin_port}/admin/usage", params={"since": "0"},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()  # fmt: skip
    finally:
        again.stop()
    assert [r["id"] for r in usage["records"]] == [*logged, answer["id"]]
    assert usage["records"][-1]["completion_tokens"] == answer["usage"]["completion_tokens"]
    assert len(list(log_dir.glob("usage-*.jsonl"))) == 1  # appended to the same file
