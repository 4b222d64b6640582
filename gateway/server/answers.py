"""The answers the server writes itself, before or instead of the app: status lines and errors."""

from __future__ import annotations

import orjson

STATUS_PHRASES = {
    100: b"Continue", 200: b"OK", 201: b"Created", 204: b"No Content", 304: b"Not Modified",
    400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed",
    408: b"Request Timeout", 413: b"Payload Too Large", 414: b"URI Too Long", 415: b"Unsupported Media Type",
    429: b"Too Many Requests", 431: b"Request Header Fields Too Large", 499: b"Client Closed Request",
    500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout",
}
_ERROR_TYPES = {408: "timeout_error", 500: "server_error", 503: "server_error"}


def error_response(status: int, message: str, code: str, extra: bytes = b"") -> bytes:
    """A complete HTTP/1.1 response in the OpenAI error shape that ends the connection."""
    body = orjson.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"), "param": None, "code": code}})
    return b"".join((
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % (status, STATUS_PHRASES.get(status, b""), len(body)),
        extra, b"\r\n", body,
    ))
