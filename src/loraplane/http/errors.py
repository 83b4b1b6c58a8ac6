"""OpenAI-style errors: every failure leaves as ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane.engine.api import OverloadedError
from loraplane.engine.core.errors import EngineDeadError
from loraplane.http.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("loraplane.http")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
PERMISSION = "permission_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"

# Engine ValueErrors name their field as "SamplingParams.top_p: ..." or "prompt_token_ids: ..."; map to ours.
_ENGINE_FIELDS = {
    "SamplingParams.temperature": "temperature",
    "SamplingParams.top_p": "top_p",
    "SamplingParams.top_k": "top_k",
    "SamplingParams.seed": "seed",
    "SamplingParams.max_tokens": "max_tokens",
    "SamplingParams.stop": "stop",
    "SamplingParams.logprobs": "logprobs",
    "SamplingParams.stop_token_ids": "stop_token_ids",
    "SamplingParams.logit_bias": "logit_bias",
    "SamplingParams.min_tokens": "min_tokens",
    "SamplingParams.presence_penalty": "presence_penalty",
    "SamplingParams.frequency_penalty": "frequency_penalty",
    "SamplingParams.repetition_penalty": "repetition_penalty",
    "SamplingParams.min_p": "min_p",
    "grammar": "response_format",  # the output left the request's grammar
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = INVALID_REQUEST,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.retry_after_s = retry_after_s

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def too_many_requests(message: str, retry_after_s: float, code: str) -> APIError:
    return APIError(429, message, type=RATE_LIMIT, code=code, retry_after_s=max(1, math.ceil(retry_after_s)))


def engine_stopped() -> APIError:
    return APIError(503, "the engine stopped; the server must be restarted", type=SERVER_ERROR,
                    code="engine_stopped")  # fmt: skip


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine_value_error(error: ValueError, prompt_field: str) -> APIError:
    """A request the engine refused: keep its message, name the OpenAI field it is about."""
    message = str(error)
    field = message.partition(":")[0]
    if field == "prompt_token_ids":
        return bad_request(message, prompt_field)
    return bad_request(message, _ENGINE_FIELDS.get(field))


def _loc_to_param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    parts = [p for p in loc if p != "body"]
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not str(part).startswith(("str", "list[", "int", "function-")):  # union branch names
            param += f".{part}" if param else str(part)
    return param or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # A union field fails once per branch; the deepest failure is the most telling ("content[0].type").
        first = max(
            errors, key=lambda e: len(e.get("loc", ())), default={"loc": (), "msg": "invalid request"}
        )
        if first.get("type") == "json_invalid":
            return bad_request(
                f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}"
            ).response()
        param = _loc_to_param(tuple(first.get("loc", ())))
        if param is None and first.get("type") == "missing":
            return bad_request("a JSON object body is required").response()
        if first.get("type") == "extra_forbidden":  # as OpenAI: a field nobody defines is not ignored
            return bad_request(
                f"{param}: unknown field (not in OpenAI's API nor vLLM's extensions)", param
            ).response()
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        log.error("engine is dead: %s", exc)
        return engine_stopped().response()

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        return too_many_requests(
            f"the server is overloaded: {exc}", exc.retry_after_s, "overloaded"
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, "internal server error", type=SERVER_ERROR).response()
