"""What every route needs: the server's state (one ServerState per process, shared by the public and the
admin app), and the dependencies that read it (the API key check, the health probes).

The route modules (openai_api.py, admin.py) and the app factory (app.py) all import this module, never each
other's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse

from loraplane.engine.api import EngineInfo
from loraplane.engine.core.async_engine import AsyncEngine
from loraplane.http.adapters import AdapterRegistry
from loraplane.http.auth import OPEN, ApiKeys, Principal
from loraplane.http.canary import Splits
from loraplane.http.errors import AUTHENTICATION, APIError
from loraplane.http.limits import KeyLimits
from loraplane.http.metrics import Metrics
from loraplane.http.models import ServedModels
from loraplane.http.structured import Grammars
from loraplane.http.usage import UsageMeter


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: object  # a transformers tokenizer (duck-typed: encode, decode, apply_chat_template)
    info: EngineInfo
    models: ServedModels
    api_keys: ApiKeys | None
    metrics: Metrics
    usage: UsageMeter  # tokens per tenant and adapter version: counters, and the usage log if any
    limits: KeyLimits = field(default_factory=KeyLimits)
    adapters: AdapterRegistry | None = None  # the admin side's, once an admin app exists
    splits: Splits = field(default_factory=Splits)  # canary traffic splits, set through the admin API
    grammars: Grammars = field(default_factory=Grammars)  # structured output's compiler, built on first use

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def health(state: ServerState) -> JSONResponse:
    """Readiness: the loaded base's hash while the engine runs, 503 once it stopped."""
    body = {"base_hash": state.info.base_hash, "model": state.models.base_name}
    if state.engine.is_alive():
        return JSONResponse({"status": "ready", **body})
    return JSONResponse({"status": "engine stopped", **body}, status_code=503)


def liveness(state: ServerState) -> JSONResponse:
    """503 once the engine is dead, so the kubelet restarts the pod (nothing else will bring it back)."""
    if state.engine.is_alive():
        return JSONResponse({"status": "live"})
    return JSONResponse({"status": "engine stopped"}, status_code=503)


def require_api_key(request: Request) -> Principal:
    """The caller the app's ApiKeyGate let in (it refused everyone else before any body was read)."""
    state = server_state(request)
    principal = getattr(request.state, "principal", None)
    if principal is None and state.api_keys is None:
        principal = OPEN
    elif principal is None:  # an app mounted without the gate
        principal = state.api_keys.authenticate(request.headers.get("authorization"))
        if principal is None:
            raise invalid_api_key()
    request.state.key_name = principal.name
    return principal


def invalid_api_key() -> APIError:
    return APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)", type=AUTHENTICATION,
                    code="invalid_api_key")  # fmt: skip
