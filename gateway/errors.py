"""Refusals and the error bodies clients see.

Every denial in the gateway is a ``Refusal``: an HTTP status, a plain-words message for the
client, a short ``reason`` (the metric label and log field) and, where one applies, the ``param``
naming the exact place in the request. Bodies follow the route's protocol: the OpenAI shape
``{"error": {"message", "type", "param", "code"}}`` or the Anthropic shape
``{"type": "error", "error": {"type", "message"}}``. Messages never carry keys, backend
addresses or stack traces.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    message: str
    reason: str
    param: str | None = None
    code: str | None = None
    type: str | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def body(self, style: str = "openai") -> bytes:
        if style == "anthropic":
            kind = self.type if self.type and self.status != 400 else ANTHROPIC_TYPES.get(self.status, "api_error")
            return orjson.dumps({"type": "error", "error": {"type": kind, "message": self.message}})
        kind = self.type or OPENAI_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return orjson.dumps(
            {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code or self.reason}}
        )


def model_not_found(model: str) -> Refusal:
    """404 for a model that does not exist or that the caller's key may not use (the same answer for both)."""
    return Refusal(
        404,
        f"The model {model[:128]!r} does not exist or you do not have access to it.",
        "model_not_found",
        param="model",
        code="model_not_found",
    )


def sse_error_event(message: str, style: str = "openai", kind: str = "server_error") -> bytes:
    """A final SSE event telling a streaming client that the stream broke after it started."""
    if style == "anthropic":
        payload = orjson.dumps({"type": "error", "error": {"type": "api_error", "message": message}})
        return b"event: error\ndata: " + payload + b"\n\n"
    payload = orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": "upstream_stream_error"}})
    return b"data: " + payload + b"\n\n"

