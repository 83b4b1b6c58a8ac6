"""The FastAPI app: OpenAI routes, health probes, API keys, a body size limit, OpenAI-style errors.

``create_app`` takes a running AsyncEngine and its tokenizer; whoever built the engine closes it. Everything
the routes need hangs off ``app.state.server`` (one ServerState, state.py), which the admin app (admin.py) shares: one
engine, one set of adapters, one metrics registry. The HTTP side sees the engine only through AsyncEngine's
public methods and the types of ``engine.api``.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from loraplane.engine.core.async_engine import AsyncEngine
from loraplane.http.auth import ApiKeys
from loraplane.http.errors import APIError, install_error_handlers
from loraplane.http.logs import RequestLog
from loraplane.http.metrics import Metrics
from loraplane.http.models import ServedModels
from loraplane.http.openai_api import router as openai_router
from loraplane.http.state import (
    ServerState,
    health,
    invalid_api_key,
    liveness,
    require_api_key,
    server_state,
)
from loraplane.http.usage import UsageMeter

DEFAULT_MAX_BODY_BYTES = 4 << 20  # far above any prompt that fits max_model_len; stops memory abuse first


class ApiKeyGate:
    """ASGI middleware: a call to a path that needs a key is refused (401) before its body is read or parsed,
    so a caller without a key learns nothing of the schema and costs no JSON parsing. The principal it lets
    in travels in the scope's state to ``require_api_key``."""

    def __init__(self, app, api_keys: ApiKeys | None) -> None:
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.api_keys is None or not _needs_key(scope["path"]):
            return await self.app(scope, receive, send)
        principal = self.api_keys.authenticate(Headers(scope=scope).get("authorization"))
        if principal is None:
            return await invalid_api_key().response()(scope, receive, send)
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


def _needs_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path == "/openapi.json"


class BodySizeLimit:
    """ASGI middleware: buffers a request body up to ``max_bytes`` and answers 413 beyond it.

    It reads the body before the app sees it (Content-Length can be absent or lie), then replays it; later
    receive() calls go to the server again, so the routes still see the client's disconnect.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        error = APIError(413, f"request body is larger than {self.max_bytes} bytes", code="body_too_large")
        await error.response()(scope, receive, send)


def create_app(
    engine: AsyncEngine,
    tokenizer,
    served_model_name: str,
    api_keys: ApiKeys | list[str] | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: Metrics | None = None,
    routing_metrics: bool = False,
    usage: UsageMeter | None = None,
) -> FastAPI:
    """The public app. Its /openapi.json needs a key whenever keys are configured. ``routing_metrics``: serve
    the routers' metric families at /metrics without a key (the endpoint picker scrapes the serving port).
    ``usage``: the token meter (by default counters in ``metrics`` only, no usage log)."""
    if not served_model_name:
        raise ValueError("served_model_name: must be non-empty")
    if isinstance(api_keys, list):
        api_keys = ApiKeys(api_keys)
    metrics = metrics if metrics is not None else Metrics()
    usage = usage if usage is not None else UsageMeter(metrics.registry, metrics.adapter_label)
    app = FastAPI(title="loraplane", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        info=engine.info(),
        models=ServedModels(served_model_name),
        api_keys=api_keys,
        metrics=metrics,
        usage=usage,
    )
    engine.add_step_listener(metrics.on_step)
    install_error_handlers(app)
    app.include_router(openai_router, prefix="/v1", dependencies=[Depends(require_api_key)])
    _add_health_routes(app)
    if routing_metrics:

        @app.get("/metrics", include_in_schema=False)
        async def routing() -> Response:
            return Response(
                metrics.routing_exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
            )

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_api_key)])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(ApiKeyGate, api_keys=api_keys)  # outside the body limit: no key, no body read
    app.add_middleware(RequestLog, metrics=metrics)
    return app


def _add_health_routes(app: FastAPI) -> None:
    """Unauthenticated: kubelet probes carry no key."""

    @app.get("/health/live")
    async def live(request: Request) -> JSONResponse:
        return liveness(server_state(request))

    @app.get("/health/ready")
    async def ready(request: Request) -> JSONResponse:
        return health(server_state(request))
