"""The admin API on its own port (the operator's contract: docs/operator.md, "The pods' admin API").

Every route needs ``Authorization: Bearer <admin token>`` (compared in constant time; the token is never
logged). Errors are ``{"reason": "<CamelCase>", "message": "..."}`` (what the operator's admin client reads)
plus the OpenAI-style ``error`` object. Adapters are a later issue: listing answers an empty list and the
calls that load or switch adapters answer 501 PodFailed with a message saying so (the operator reports a
clear per-pod failure rather than a connection error); unloading answers 404 (nothing is loaded).
"""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .app import ServerState, base_hash_of
from .errors import AUTHENTICATION, INVALID_REQUEST, NOT_FOUND, SERVER_ERROR

POD_FAILED = "PodFailed"  # the operator's reason for "a pod refused for another reason"
UNAUTHORIZED = "Unauthorized"
NOT_SUPPORTED = (
    "adapters are not supported by this server build yet (base model only); upgrade the server image"
)


class AdminError(Exception):
    def __init__(self, status: int, reason: str, message: str, type: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.type = status, reason, message, type

    def response(self) -> JSONResponse:
        body = {
            "reason": self.reason,
            "message": self.message,
            "error": {"message": self.message, "type": self.type, "param": None, "code": self.reason},
        }
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def read_admin_token(path: str | Path) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"admin_token_file: cannot read {path}: {exc.strerror}") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"admin_token_file: {path} must hold one token (non-empty, no whitespace)")
    return token


def create_admin_app(state: ServerState, token: str) -> FastAPI:
    """The admin app over the public app's state (``app.state.server``): one engine, one set of models."""
    if not token:
        raise ValueError("admin_token: must be non-empty")
    expected = f"Bearer {token}".encode()

    def require_admin_token(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise AdminError(401, UNAUTHORIZED, "missing or invalid admin token", AUTHENTICATION)

    app = FastAPI(title="loraplane admin", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _install_error_handlers(app)
    _add_routes(app, Depends(require_admin_token))
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AdminError)
    async def _admin(_: Request, exc: AdminError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        reason = "NotFound" if exc.status_code == 404 else POD_FAILED
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return AdminError(exc.status_code, reason, str(exc.detail), kind).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return AdminError(422, POD_FAILED, f"invalid request: {exc.errors()[:1]}").response()


def _add_routes(app: FastAPI, auth) -> None:
    @app.get("/health/live", dependencies=[auth])
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/health/ready", dependencies=[auth])
    async def ready(request: Request) -> JSONResponse:
        state: ServerState = request.app.state.server
        body = {"base_hash": base_hash_of(state), "model": state.models.base_name}
        if state.engine.is_alive():
            return JSONResponse({"status": "ready", **body})
        return JSONResponse({"status": "engine stopped", **body}, status_code=503)

    @app.get("/admin/adapters", dependencies=[auth])
    async def list_adapters(request: Request, name: str | None = None) -> dict:
        return {"base_hash": base_hash_of(request.app.state.server), "adapters": []}

    async def not_supported(name: str) -> None:
        raise AdminError(501, POD_FAILED, f"adapter {name!r}: {NOT_SUPPORTED}", SERVER_ERROR)

    @app.delete("/admin/adapters/{name}", dependencies=[auth])
    async def unload(name: str) -> None:
        # Nothing is ever loaded here; 404 is what the operator reads as "already unloaded", so deleting a
        # LoRAAdapter does not hang on its finalizer.
        raise AdminError(404, "NotFound", f"adapter {name!r} is not loaded ({NOT_SUPPORTED})", NOT_FOUND)

    app.put("/admin/adapters/{name}", dependencies=[auth])(not_supported)
    app.post("/admin/adapters/{name}/alias", dependencies=[auth])(not_supported)
