"""API errors as ``kind: Status`` bodies, and small wire helpers shared by the emulator's modules."""

from __future__ import annotations

import datetime
import json
from typing import Any

import aiohttp.web

from tests.kube.resources import ResourceType

JSON = "application/json"


class ApiError(Exception):
    """An API failure rendered as a ``kind: Status`` body."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def body(self) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }

    @classmethod
    def not_found(cls, rt: ResourceType, name: str) -> ApiError:
        return cls(404, "NotFound", f'{rt.qualified} "{name}" not found', _details(rt, name))

    @classmethod
    def already_exists(cls, rt: ResourceType, name: str) -> ApiError:
        return cls(409, "AlreadyExists", f'{rt.qualified} "{name}" already exists', _details(rt, name))

    @classmethod
    def conflict(cls, rt: ResourceType, name: str, why: str = "") -> ApiError:
        why = (
            why
            or "the object has been modified; please apply your changes to the latest version and try again"
        )
        return cls(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}',
            _details(rt, name),
        )

    @classmethod
    def invalid(cls, rt: ResourceType, name: str, field: str, why: str) -> ApiError:
        return cls(
            422,
            "Invalid",
            f'{rt.kind} "{name}" is invalid: {field}: {why}',
            {
                **_details(rt, name),
                "causes": [{"reason": "FieldValueInvalid", "message": why, "field": field}],
            },
        )


def _details(rt: ResourceType, name: str) -> dict[str, Any]:
    return {"name": name, "group": rt.group, "kind": rt.plural}


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def not_found_url() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


def json_response(data: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(body=json.dumps(data).encode(), status=status, content_type=JSON)
