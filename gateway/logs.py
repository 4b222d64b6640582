"""Log lines: plain text for a terminal, or one JSON object per line for a log pipeline.

``configure(format, level)`` installs the formatter once at start-up. Structured fields travel
in ``extra={"fields": {...}}`` (``event(...)`` builds them) so the same call reads well in both
formats. The access line is built from a finished request by ``access_fields``: it names the key
by its configured name and a short id of its hash, and never carries a key, a prompt, a body or
a media URL.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

import orjson

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

access_log = logging.getLogger("gateway.access")
# What the access line's message already says in text form; the text formatter adds the rest.
IN_ACCESS_MESSAGE = frozenset({"event", "client", "method", "path", "status", "duration_ms", "key", "model"})


def event(logger: logging.Logger, name: str, message: str, *args: Any, level: int = logging.INFO, **fields: Any) -> None:
    """One structured event: ``message % args`` for people, ``event`` and ``fields`` for machines."""
    if logger.isEnabledFor(level):
        logger.log(level, message, *args, extra={"fields": {"event": name, **fields}})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields and record.name == access_log.name:
            line += "".join(f" {k}={_text_value(v)}" for k, v in fields.items() if v is not None and k not in IN_ACCESS_MESSAGE)
        return line


def _text_value(value: Any) -> str:
    text = str(value)
    return text if text and " " not in text and '"' not in text else orjson.dumps(text).decode()


def configure(fmt: str = "text", level: str = "info", stream: TextIO | None = None) -> logging.Handler:
    """Route every logger through one handler with the chosen format; returns that handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore"):  # one line per health probe otherwise
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return handler


def access_fields(
    *,
    request_id: str,
    method: str,
    path: str,
    route: str,
    status: int,
    duration: float,
    client: str,
    key: str | None,
    model: str | None,
    backend: str | None,
    ttfb: float | None,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    refusal: str | None,
) -> dict[str, Any]:
    return {
        "event": "access",
        "request_id": request_id,
        "client": client,
        "method": method,
        "path": path[:128],  # the path policy already refused anything odd; bounded anyway
        "route": route,
        "status": status,
        "duration_ms": round(duration * 1000, 3),
        "ttfb_ms": round(ttfb * 1000, 3) if ttfb is not None else None,
        "key": key,
        "model": model[:128] if model else None,
        "backend": backend,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "refusal": refusal,
    }
