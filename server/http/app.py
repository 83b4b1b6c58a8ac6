"""The FastAPI app: OpenAI routes, health probes, API keys, a body size limit, OpenAI-style errors.

``create_app`` takes a running AsyncEngine and its tokenizer; whoever built the engine closes it. Everything
the routes need hangs off ``app.state.server`` (one ServerState), so the admin API of the multi-LoRA issue
adds its router and its own fields without touching these routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from loraplane.server.engine.async_engine import AsyncEngine

from .auth import ApiKeys, Principal
from .errors import AUTHENTICATION, NOT_FOUND, APIError, install_error_handlers
from .protocol import ModelCard, now

DEFAULT_MAX_BODY_BYTES = 4 << 20  # far above any prompt that fits max_model_len; stops memory abuse first


@dataclass(slots=True)
class ServedModels:
    """What the ``model`` field may name. Now only the base; the multi-LoRA issue adds adapter aliases."""

    base_name: str
    created: int = field(default_factory=now)

    def resolve(self, name: str) -> str | None:
        """The engine adapter for ``name`` (None: the base model); 404 naming ``model`` when unknown."""
        if name == self.base_name:
            return None
        raise APIError(
            404, f"The model `{name}` does not exist.", param="model", type=NOT_FOUND, code="model_not_found"
        )

    def cards(self) -> list[ModelCard]:
        return [ModelCard(id=self.base_name, created=self.created, root=self.base_name)]


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: object  # a transformers tokenizer (duck-typed: encode, decode, apply_chat_template)
    models: ServedModels
    api_keys: ApiKeys | None
    max_model_len: int
    vocab_size: int | None  # token ids in a prompt must be below it


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def base_hash_of(state: ServerState) -> str | None:
    """The loaded weights' base hash (what the operator compares across pods)."""
    return getattr(state.engine.engine.runner, "base_hash", None)


def require_api_key(request: Request) -> Principal | None:
    keys = server_state(request).api_keys
    if keys is None:
        return None
    principal = keys.authenticate(request.headers.get("authorization"))
    if principal is None:
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                       type=AUTHENTICATION, code="invalid_api_key")  # fmt: skip
    return principal


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
) -> FastAPI:
    from .openai_api import router as openai_router

    if not served_model_name:
        raise ValueError("served_model_name: must be non-empty")
    if isinstance(api_keys, list):
        api_keys = ApiKeys(api_keys)
    app = FastAPI(title="loraplane", docs_url=None, redoc_url=None)
    app.state.server = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        models=ServedModels(served_model_name),
        api_keys=api_keys,
        max_model_len=engine.engine.max_model_len,
        vocab_size=getattr(engine.engine.runner, "vocab_size", None),
    )
    install_error_handlers(app)
    app.include_router(openai_router, prefix="/v1", dependencies=[Depends(require_api_key)])
    _add_health_routes(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app


def _add_health_routes(app: FastAPI) -> None:
    """Unauthenticated: kubelet probes carry no key."""

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/health/ready")
    async def ready(request: Request) -> JSONResponse:
        state = server_state(request)
        body = {"base_hash": base_hash_of(state), "model": state.models.base_name}
        if state.engine.is_alive():
            return JSONResponse({"status": "ready", **body})
        return JSONResponse({"status": "engine stopped", **body}, status_code=503)
