"""Faults a real API server will not make on demand, injected by a proxy in front of it.

``FaultProxy(plane)`` listens on plain HTTP on loopback and forwards every request to the real kube-apiserver
(over its TLS, with the caller's own Authorization header), except those a rule claims: ``fail(method,
path_regex, code, times)`` answers the next ``times`` matches with a Kubernetes Status of that code (409
conflict storms, 5xx), and ``delay(...)`` holds them first (slow answers, or a stalled server). ``requests`` logs (method, path,
status) of everything that passed. Scope: single request/response calls, which is what the operator's own
API module makes; watches are not proxied (their responses never end), so point kopf at the real server.
"""

from __future__ import annotations

import http.client
import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
REASONS = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}


@dataclass
class Rule:
    method: str
    path: re.Pattern
    code: int | None  # None: forward after the delay
    times: int | None  # None: every match
    delay: float = 0.0

    def claims(self, method: str, path: str) -> bool:
        return self.times != 0 and method == self.method and self.path.fullmatch(path) is not None


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # a client that gave up waiting for a held answer is not news
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FaultProxy:
    def __init__(self, plane):
        self.plane = plane
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str, int]] = []
        self.connections = 0  # TCP connections accepted from clients (a pooled client keeps a few alive)
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"proxy": self})
        self._server = _Server(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True).start()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fail(self, method: str, path_regex: str, code: int = 500, times: int | None = 1) -> None:
        """Answer the next ``times`` requests (None: all) whose path fully matches with a Status ``code``."""
        self.rules.append(Rule(method.upper(), re.compile(path_regex), code, times))

    def delay(
        self, method: str, path_regex: str, seconds: float, times: int | None = 1, code: int | None = None
    ) -> None:
        """Hold the next ``times`` matches ``seconds``, then forward them (or answer a Status ``code``)."""
        self.rules.append(Rule(method.upper(), re.compile(path_regex), code, times, seconds))

    def count(self, method: str, contains: str = "") -> int:
        return sum(1 for m, path, _ in self.requests if m == method.upper() and contains in path)

    def api_client(self, token: str | None = None, pool_size: int | None = None):
        """A ``kubernetes.client.ApiClient`` that goes through the proxy (admin unless ``token``), keeping up to
        ``pool_size`` connections alive (the client's default, 10, unless given)."""
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.url
        if pool_size:
            configuration.connection_pool_maxsize = pool_size
        configuration.api_key = {"authorization": f"Bearer {token or self.plane.admin_token}"}
        return client.ApiClient(configuration)

    def _claim(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.claims(method, path):
                    if rule.times is not None:
                        rule.times -= 1
                    return rule
        return None


class _Handler(BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet test output
        pass

    def setup(self) -> None:  # once per client connection (HTTP/1.1: many requests each)
        super().setup()
        with self.proxy._lock:
            self.proxy.connections += 1

    def _relay(self) -> None:
        proxy, method = self.proxy, self.command
        path = urlparse(self.path).path
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        rule = proxy._claim(method, path)
        if rule is not None and rule.delay:
            time.sleep(rule.delay)
        if rule is not None and rule.code is not None:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": rule.code,
                      "reason": REASONS.get(rule.code, "InternalError"), "message": "injected by the test"}  # fmt: skip
            self._answer(rule.code, {"Content-Type": "application/json"}, json.dumps(status).encode())
            proxy.requests.append((method, path, rule.code))
            return
        target = urlparse(proxy.plane.url)
        upstream = http.client.HTTPSConnection(target.hostname, target.port, timeout=60,
                                               context=proxy.plane.ssl_context())  # fmt: skip
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            upstream.request(method, self.path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
            kept = {k: v for k, v in answer.getheaders() if k.lower() not in HOP_BY_HOP}
            self._answer(answer.status, kept, data)
            proxy.requests.append((method, path, answer.status))
        finally:
            upstream.close()

    def _answer(self, code: int, headers: dict, data: bytes) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _relay  # noqa: N815
