"""A recording stand-in for a server pod's admin API (docs/operator.md), with injectable failures.

Each ``FakePod`` is a threaded stdlib HTTP server on its own loopback address (127.0.0.N) and the
shared admin port, so a pod's ``status.podIP`` is all the operator needs, as with real pods.
Failures (``pod.fail``): ``refuse`` (server stopped: connection refused), ``500``, ``hang``
(never answers within the client's timeout), ``wrong_base`` (refuses every load: BaseMismatch),
``warm_fail:<version>`` (that version fails to warm), ``hold_warm`` (loads answer 202 until the test
clears ``fail``: no timing involved).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


@dataclass
class Entry:
    name: str
    version: str
    digest: str
    uri: str
    state: str = "warm"


class FakePod:
    def __init__(self, ip: str, port: int, token: str, base_hash: str):
        self.ip, self.port, self.token, self.base_hash = ip, port, token, base_hash
        self.fail: str | None = None
        self.entries: dict[tuple[str, str], Entry] = {}
        self.alias: dict[str, str] = {}
        self.requests: list[tuple[str, str, dict | None]] = []  # (method, path, body)
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.start()

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"pod": self})
        server_cls = type(
            "Server", (ThreadingHTTPServer,), {"request_queue_size": 512}
        )  # like uvicorn's backlog
        self._server = server_cls((self.ip, self.port), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def restart(self) -> None:
        """A container restart: same address, every adapter forgotten."""
        with self.lock:
            self.entries.clear()
            self.alias.clear()

    # --- what tests read ---------------------------------------------------------------------------
    def serving(self, name: str) -> str | None:
        with self.lock:
            return self.alias.get(name)

    def versions(self, name: str) -> set[str]:
        with self.lock:
            return {v for (n, v) in self.entries if n == name}

    def count(self, method: str, prefix: str = "/admin/adapters") -> int:
        with self.lock:
            return sum(1 for m, p, _ in self.requests if m == method and p.startswith(prefix))

    # --- the API -----------------------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict, body: dict | None) -> tuple[int, dict]:
        with self.lock:
            self.requests.append((method, path, body))
        if self.fail == "500":
            return 500, {"message": "injected failure"}
        if path == "/health/ready":
            return 200, {"status": "ready", "base_hash": self.base_hash}
        parts = path.strip("/").split("/")
        with self.lock:
            if parts == ["admin", "adapters"] and method == "GET":
                only = query.get("name", [None])[0]
                views = [self._view(e) for e in self.entries.values() if only in (None, e.name)]
                return 200, {"base_hash": self.base_hash, "adapters": views}
            if len(parts) == 3 and method == "PUT":
                return self._load(parts[2], body or {})
            if len(parts) == 3 and method == "DELETE":
                return self._unload(parts[2], query.get("version", [None])[0])
            if len(parts) == 4 and parts[3] == "alias" and method == "POST":
                return self._switch(parts[2], (body or {}).get("version"))
        return 404, {"reason": "NotFound", "message": f"{method} {path}"}

    def _view(self, entry: Entry) -> dict:
        serving = self.alias.get(entry.name) == entry.version
        return {"name": entry.name, "version": entry.version, "digest": entry.digest, "state": entry.state,
                "serving": serving}  # fmt: skip

    def _load(self, name: str, body: dict) -> tuple[int, dict]:
        version = body.get("version", "")
        if self.fail == "wrong_base":
            return 409, {
                "reason": "BaseMismatch",
                "message": "adapter base hash differs from this pod's base",
            }
        if self.fail == f"warm_fail:{version}":
            return 500, {"reason": "WarmFailed", "message": f"warm-up forward pass failed for {version}"}
        key = (name, version)
        entry = self.entries.get(key)
        if entry is None:
            entry = Entry(name, version, body.get("manifest_digest", ""), body.get("uri", ""))
            self.entries[key] = entry
        if self.fail == "hold_warm":
            entry.state = "loaded"
            return 202, self._view(entry)
        entry.state = "warm"
        if name not in self.alias:
            self.alias[name] = version
        return 200, self._view(entry)

    def _unload(self, name: str, version: str | None) -> tuple[int, dict]:
        keys = [k for k in self.entries if k[0] == name and (version is None or k[1] == version)]
        if not keys:
            return 404, {"reason": "NotFound", "message": f"{name} not loaded"}
        for key in keys:
            del self.entries[key]
            if self.alias.get(name) == key[1]:
                del self.alias[name]
        return 200, {}

    def _switch(self, name: str, version: str | None) -> tuple[int, dict]:
        entry = self.entries.get((name, version or ""))
        if entry is None or entry.state != "warm":
            return 409, {"reason": "NotWarm", "message": f"{name}@{version} is not warm here"}
        self.alias[name] = entry.version
        return 200, self._view(entry)


class _Handler(BaseHTTPRequestHandler):
    pod: FakePod

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _serve(self, method: str) -> None:
        pod = self.pod
        if pod.fail == "hang":
            time.sleep(30)
            return
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        if self.headers.get("Authorization") != f"Bearer {pod.token}":
            status, payload = 401, {"reason": "Unauthorized", "message": "bad admin token"}
        else:
            status, payload = pod.handle(method, url.path, parse_qs(url.query), body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._serve("GET")

    def do_PUT(self):  # noqa: N802
        self._serve("PUT")

    def do_POST(self):  # noqa: N802
        self._serve("POST")

    def do_DELETE(self):  # noqa: N802
        self._serve("DELETE")
