"""The log of requests as they arrived, for tests that prove what the gateway let through.

Entries keep the raw ASGI pieces; JSON parsing and decoding happen only when someone reads the
log, so recording costs one tuple on the hot path. The log is bounded (``--record-limit``),
oldest first out, so a long benchmark cannot grow it without end.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import orjson


class RequestRecorder:
    def __init__(self, limit: int) -> None:
        self._entries: deque[tuple[float, str, str, bytes | None, bytes, list[tuple[bytes, bytes]], bytes]] = deque(maxlen=limit)
        self.total = 0

    def record(self, scope: dict[str, Any], body: bytes) -> None:
        self.total += 1
        self._entries.append(
            (time.time(), scope["method"], scope["path"], scope.get("raw_path"), scope.get("query_string", b""), list(scope["headers"]), body)
        )

    def clear(self) -> None:
        self._entries.clear()

    def snapshot(self) -> list[dict[str, Any]]:
        return [_render(e) for e in self._entries]


def _render(entry: tuple[float, str, str, bytes | None, bytes, list[tuple[bytes, bytes]], bytes]) -> dict[str, Any]:
    ts, method, path, raw_path, query, raw_headers, body = entry
    headers: dict[str, str] = {}
    for name, value in raw_headers:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        # Repeated headers are joined as HTTP allows, so a smuggled duplicate stays visible.
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    parsed: Any = None
    body_text: str | None = None
    if body:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            body_text = body.decode("utf-8", errors="replace")
    return {
        "time": ts,
        "method": method,
        "path": path,
        "raw_path": raw_path.decode("latin-1") if raw_path is not None else path,
        "query": query.decode("latin-1"),
        "headers": headers,
        "body": parsed,
        "body_text": body_text,
    }
