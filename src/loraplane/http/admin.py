"""The admin API on its own port (the operator's contract: docs/operator.md, "The pods' admin API").

Every route, /metrics and the probes included, needs ``Authorization: Bearer <admin token>`` (the same
Bearer rule as the public port; compared in constant time; never logged). Errors are
``{"reason": "<CamelCase>", "message": "..."}`` (what the operator's admin client reads) plus the
OpenAI-style ``error`` object. None of these routes exists on the public app.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from pathlib import Path
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane.engine.api import AdapterError
from loraplane.http.adapters import FAILED, LOADED, WARM, AdapterRegistry, LoadFailed, LoadSpec, unload_from
from loraplane.http.auth import bearer_token
from loraplane.http.errors import AUTHENTICATION, INVALID_REQUEST, NOT_FOUND, SERVER_ERROR
from loraplane.http.logs import RequestLog
from loraplane.http.state import ServerState, health, liveness
from loraplane.http.usage_log import parse_since, query
from loraplane.http.views import adapter_views

POD_FAILED = "PodFailed"  # the operator's reason for "a pod refused for another reason"
UNAUTHORIZED = "Unauthorized"
NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$"  # a URL segment and a Prometheus label value
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
DEFAULT_WAIT_S = 5.0  # a PUT waits this long for the load to finish before answering 202

AdapterName = Annotated[str, PathParam(pattern=NAME_PATTERN)]
Version = Annotated[str, Field(pattern=NAME_PATTERN)]


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


class LoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str = Field(pattern=r"^s3://", max_length=1024)
    version: Version
    manifest_digest: str | None = Field(default=None, pattern=DIGEST_PATTERN)
    pin: bool = False
    # gpu | host: pull, load and warm now. disk: pull and verify onto this node's disk now, and register it
    # on the disk tier: its first request loads it. lazy: verify the signed manifest only; the first request
    # that names the version pulls it (on the engine's loader), so registering thousands pulls nothing.
    warm: Literal["gpu", "host", "disk", "lazy"] = "gpu"


class AliasBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Version


class SplitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Version  # the canary: a warm version beside the serving one
    weight: int = Field(ge=0, le=100, strict=True)  # percent of the name's requests sent to it


class PinBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Version
    pinned: bool = True


def read_admin_token(path: str | Path) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"admin_token_file: cannot read {path}: {exc.strerror}") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"admin_token_file: {path} must hold one token (non-empty, no whitespace)")
    return token


def create_admin_app(state: ServerState, token: str, registry: AdapterRegistry | None = None,
                     *, wait_s: float = DEFAULT_WAIT_S) -> FastAPI:  # fmt: skip
    """The admin app over the public app's state: one engine, one set of adapters, one metrics registry.

    Without a registry (no --host-cache-dir) adapters can still be listed, switched, pinned and unloaded;
    loads from S3 answer 500 PodFailed naming the missing setting.
    """
    if not token:
        raise ValueError("admin_token: must be non-empty")
    app = FastAPI(title="loraplane admin", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    state.adapters = registry
    _install_error_handlers(app)
    _add_routes(app, state, registry, wait_s)
    _add_usage_route(app, state)
    app.add_middleware(AdminAuth, token=token)
    app.add_middleware(RequestLog, metrics=state.metrics)
    return app


class AdminAuth:
    """ASGI middleware: every request, unknown paths included, needs the token before anything answers."""

    def __init__(self, app, token: str) -> None:
        self.app, self._expected = app, hashlib.sha256(token.encode()).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            given = hashlib.sha256((bearer_token(header) or "").encode()).digest()
            if not hmac.compare_digest(given, self._expected):
                error = AdminError(401, UNAUTHORIZED, "missing or invalid admin token", AUTHENTICATION)
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AdminError)
    async def _admin(_: Request, exc: AdminError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(LoadFailed)
    async def _load(_: Request, exc: LoadFailed) -> JSONResponse:
        return AdminError(exc.status, exc.reason, exc.message, SERVER_ERROR).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        reason = "NotFound" if exc.status_code == 404 else POD_FAILED
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return AdminError(exc.status_code, reason, str(exc.detail), kind).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query"))
        return AdminError(422, "InvalidRequest", f"{where or 'body'}: {first['msg']}").response()


def _add_routes(app: FastAPI, state: ServerState, registry: AdapterRegistry | None, wait_s: float) -> None:
    engine = state.engine

    @app.get("/health/live")
    async def live() -> JSONResponse:
        return liveness(state)

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        return health(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/admin/adapters")
    async def list_adapters(name: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None) -> dict:
        return {"base_hash": state.info.base_hash, "adapters": _views(name)}

    def _views(name: str | None) -> list[dict]:
        """The views of every adapter, or of ``name`` alone (built for that name only: a pod may hold
        thousands, and the operator asks about one at a time)."""
        entries = registry.entries if registry else {}
        if name is not None:
            entries = {k: e for k, e in entries.items() if e.spec.name == name}
        return adapter_views(engine.adapters(name), entries)

    @app.put("/admin/adapters/{name}")
    async def load(name: AdapterName, body: LoadBody) -> JSONResponse:
        if registry is None:
            raise AdminError(500, POD_FAILED, "this server has no --host-cache-dir: it cannot pull adapters",
                             SERVER_ERROR)  # fmt: skip
        spec = LoadSpec(name, body.version, body.uri, body.manifest_digest, body.pin, body.warm == "gpu",
                        lazy=body.warm == "lazy", disk=body.warm == "disk")  # fmt: skip
        entry = await registry.ensure(spec, wait_s)
        if entry.state == FAILED and entry.error is not None:
            raise entry.error
        view = _view_of(name, body.version)
        done = entry.state == WARM or (spec.deferred and entry.state == LOADED)
        return JSONResponse(view, status_code=200 if done else 202)

    def _view_of(name: str, version: str) -> dict:
        return next(v for v in _views(name) if v["version"] == version)

    @app.post("/admin/adapters/{name}/alias")
    async def alias(name: AdapterName, body: AliasBody) -> dict:
        _require_warm(engine, name, body.version)
        await engine.set_alias(name, body.version)
        return _view_of(name, body.version)

    @app.post("/admin/adapters/{name}/pin")
    async def pin(name: AdapterName, body: PinBody) -> dict:
        try:
            if registry is not None:
                await registry.set_pin(name, body.version, body.pinned)
            else:
                await engine.pin_adapter(name, body.version, body.pinned)
        except AdapterError as exc:
            raise AdminError(404, "NotFound", exc.message, NOT_FOUND) from None
        return _view_of(name, body.version)

    _add_split_routes(app, state)

    @app.delete("/admin/adapters/{name}")
    async def unload(name: AdapterName, version: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None):
        state.splits.drop(name, version)  # never route to a version that is going away
        if registry is not None:
            gone = await registry.unload(name, version)
        else:
            gone = await unload_from(engine, name, version)
            state.metrics.unloads.inc(len(gone))
        if not gone:
            what = f"{name}@{version}" if version else name
            raise AdminError(404, "NotFound", f"{what} is not loaded here", NOT_FOUND)
        return {"unloaded": gone}


def _require_warm(engine, name: str, version: str) -> None:
    """404 unless ``name@version`` is loaded here, 409 unless it is warm: an alias or a split must never point
    at a version that cannot answer at once."""
    info = next((a for a in engine.adapters(name) if a.version == version), None)
    if info is None:
        raise AdminError(404, "NotFound", f"{name}@{version} is not loaded here", NOT_FOUND)
    if info.state != WARM:
        raise AdminError(409, "NotWarm", f"{name}@{version} is {info.state}, not warm")


def _add_split_routes(app: FastAPI, state: ServerState) -> None:
    """Canary traffic splits (http/canary.py): set, read (with each version's window of counts), remove."""
    engine, splits = state.engine, state.splits

    def view(name: str) -> dict:
        split = splits.get(name)
        if split is None:
            raise AdminError(404, "NotFound", f"{name} has no traffic split here", NOT_FOUND)
        serving = engine.resolve(name)
        return split.view(serving.partition("@")[2] if serving else None)

    @app.put("/admin/adapters/{name}/split")
    async def set_split(name: AdapterName, body: SplitBody) -> dict:
        _require_warm(engine, name, body.version)
        if engine.resolve(name) is None:
            raise AdminError(409, "NotServing", f"no version of {name} serves here: nothing to split with")
        splits.set(name, body.version, body.weight)
        return view(name)

    @app.get("/admin/adapters/{name}/split")
    async def get_split(name: AdapterName) -> dict:
        return view(name)

    @app.get("/admin/splits")
    async def list_splits() -> dict:
        return {"splits": [view(split.name) for split in splits.all()]}

    @app.delete("/admin/adapters/{name}/split")
    async def drop_split(name: AdapterName) -> dict:
        if not splits.drop(name):
            raise AdminError(404, "NotFound", f"{name} has no traffic split here", NOT_FOUND)
        return {"removed": name}


TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"  # a key's name in the keys file


def _add_usage_route(app: FastAPI, state: ServerState) -> None:
    @app.get("/admin/usage")
    async def usage(
        since: str | None = None,
        tenant: Annotated[str | None, Query(pattern=TENANT_PATTERN)] = None,
        adapter: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> dict:
        """The usage log's records of requests that ended at ``since`` or later, and their totals."""
        if since is None:
            raise AdminError(400, "InvalidRequest", "since: required (unix seconds or an RFC 3339 time)")
        try:
            start = parse_since(since)
        except ValueError as exc:
            raise AdminError(400, "InvalidRequest", str(exc)) from None
        if state.usage.log is None:
            raise AdminError(404, "NoUsageLog", "this server keeps no usage log (start it with --usage-log-dir)",
                             NOT_FOUND)  # fmt: skip
        return await asyncio.to_thread(query, state.usage.log, start, tenant, adapter, limit)
