"""Error bodies in the shapes the real api_server sends, so the gateway is tested against them.

- ``openai``: lmdeploy's flat ``ErrorResponse``
  ``{"object": "error", "message", "type", "param", "code": <http status>}``;
- ``responses``: ``{"error": {"message", "type", "param", "code": <http status>}}``;
- ``anthropic``: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.background import BackgroundTask
from starlette.responses import Response

OPENAI, RESPONSES, ANTHROPIC = "openai", "responses", "anthropic"

_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error"}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class ApiError(Exception):
    """Raised by a handler; rendered in the style of the route that raised it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type


def style_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    if path.startswith("/v1/responses"):
        return RESPONSES
    return OPENAI


def error_body(style: str, status: int, message: str, *, param: str | None = None, type: str | None = None) -> dict[str, Any]:
    if style == ANTHROPIC:
        kind = type or _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = type or _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if style == RESPONSES:
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return {"object": "error", "message": message, "type": kind, "param": param, "code": status}


def json_response(content: Any, status: int = 200, *, background: BackgroundTask | None = None) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json", background=background)


def error_response(style: str, status: int, message: str, *, param: str | None = None, type: str | None = None) -> Response:
    return json_response(error_body(style, status, message, param=param, type=type), status)


def api_error_response(style: str, exc: ApiError) -> Response:
    return error_response(style, exc.status, exc.message, param=exc.param, type=exc.type)
