"""Structured logs: one JSON object per line, each with the request id of the request it belongs to.

A request's id comes from its ``X-Request-Id`` header when that is a short token, else a new one; it is sent
back in the response's ``X-Request-Id``. The access line names the caller by its key's label, never the key:
no header value other than the request id is ever logged.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("loraplane_request_id", default=None)
_GOOD_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})

access_log = logging.getLogger("loraplane.http.access")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            line["request_id"] = request_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """For people: the usual line, then the request id and the structured fields as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "fields", None) or {})
        request_id = REQUEST_ID.get()
        if request_id is not None:
            fields = {"request_id": request_id, **fields}
        extra = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        return f"{super().format(record)} {extra}".rstrip()


def configure(level: str = "info", json_lines: bool = True) -> None:
    """Log lines to stderr, as logging.basicConfig does: a process that set up logging already keeps it."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    if root.handlers:
        return
    handler = logging.StreamHandler()
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root.addHandler(handler)


def endpoint_of(path: str) -> str:
    return path if path in ENDPOINTS else "other"


class RequestLog:
    """ASGI middleware: request id, one access log line, and the per-status counter and duration."""

    def __init__(self, app, metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _GOOD_ID.fullmatch(given) else uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)
        status, started = 500, time.perf_counter()

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._record(scope, status, time.perf_counter() - started)
            REQUEST_ID.reset(token)

    def _record(self, scope, status: int, seconds: float) -> None:
        state = scope.get("state") or {}
        endpoint = endpoint_of(scope["path"])
        adapter = state.get("adapter_label", "none")  # "none": refused before `model` was resolved
        if endpoint != "other":
            self.metrics.requests.labels(endpoint, str(status), adapter).inc()
            if endpoint != "/v1/models":
                self.metrics.e2e.labels(endpoint).observe(seconds)
        fields = {"method": scope["method"], "path": scope["path"], "status": status,
                  "duration_s": round(seconds, 4), "key": state.get("key_name"), "model": state.get("model")}  # fmt: skip
        access_log.info("request", extra={"fields": fields})
