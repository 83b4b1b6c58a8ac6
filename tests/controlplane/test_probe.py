"""The process runtime's readiness probe behaves as a kubelet's: Ready after one success, not Ready only after
``failureThreshold`` failures in a row, probed at most once per period (a busy server's one slow answer does not
take it out of its Service)."""

from __future__ import annotations

import http.server
import threading

from tests.controlplane.cluster import free_port
from tests.controlplane.processes import Probe


class Answers(http.server.BaseHTTPRequestHandler):
    codes: list[int] = []

    def do_GET(self):  # noqa: N802 - the http.server API
        self.send_response(self.codes.pop(0) if self.codes else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_ready_after_one_success_and_not_ready_only_after_the_threshold():
    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        Answers.codes = [503, 200, 503, 503, 200, 503, 503, 503]
        probe = Probe(f"http://127.0.0.1:{port}/ready", period=0.0, timeout=2.0, failures=3)
        seen = [probe.check() for _ in range(8)]
        assert seen == [False, True, True, True, True, True, True, False]
        slow = Probe(f"http://127.0.0.1:{port}/ready", period=3600.0, timeout=2.0, failures=1)
        Answers.codes = [200, 503]
        assert slow.check() and slow.check(), "within its period the probe is not run again"
    finally:
        server.shutdown()
        server.server_close()
