"""Body hygiene: JSON only, bounded in size and depth, parsed once and strictly.

The gateway forwards its own serialisation of what it validated, never the client's bytes, so a
backend cannot read something different from the same bytes (duplicate keys, odd escapes,
another encoding). Engine knobs that address sessions, caches or processors are removed.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from ..config import LimitsConfig
from ..errors import Refusal
from . import RequestContext


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_decoder = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_reject_constant, strict=True)


def _bad(message: str, reason: str, param: str | None = None) -> Refusal:
    return Refusal(400, message, reason, param=param, code="invalid_request_body")


UNSUPPORTED_MEDIA_TYPE = Refusal(415, "Content-Type must be application/json.", "unsupported_media_type", code="unsupported_media_type")


class BodyPolicy:
    def __init__(self, cfg: LimitsConfig):
        self.max_bytes = cfg.max_body_bytes
        self.max_depth = cfg.max_json_depth
        self.drop = tuple(cfg.drop_fields)
        self.too_large = Refusal(
            413, f"Request body is larger than the limit of {self.max_bytes} bytes.", "body_too_large", code="request_too_large"
        )

    # -- header stage ---------------------------------------------------------------------------
    def check_headers(self, ctx: RequestContext) -> Refusal | None:
        ctype = ctx.headers.get(b"content-type")
        if ctype is None or b"\x00" in ctype:
            return UNSUPPORTED_MEDIA_TYPE
        mime, _, params = ctype.partition(b";")
        if mime.strip().lower() != b"application/json":
            return UNSUPPORTED_MEDIA_TYPE
        if params:
            for p in params.split(b";"):
                name, _, value = p.partition(b"=")
                if name.strip().lower() == b"charset" and value.strip().strip(b'"').lower() not in (b"utf-8", b"utf8"):
                    return UNSUPPORTED_MEDIA_TYPE
        length = ctx.headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or b"\x00" in length:
                return _bad("Invalid Content-Length header.", "invalid_content_length")
            if int(length) > self.max_bytes:
                return self.too_large
        return None

    # -- body stage ---------------------------------------------------------------------------------
    def parse(self, ctx: RequestContext, raw: bytes) -> Refusal | None:
        """Parse strictly into ctx.body and ctx.model; drop engine knobs."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return _bad("Request body is not valid UTF-8.", "invalid_utf8")
        try:
            body = _decoder.decode(text)
        except _DuplicateKey as exc:
            return _bad(f"Duplicate key {str(exc)[:64]!r} in the request body.", "duplicate_key")
        except RecursionError:
            return _bad(f"Request body is nested deeper than {self.max_depth} levels.", "too_deep")
        except ValueError as exc:
            msg = str(exc).split(":")[0][:120]
            return _bad(f"Request body is not valid JSON: {msg}.", "invalid_json")
        if not isinstance(body, dict):
            return _bad("Request body must be a JSON object.", "not_an_object")
        if _depth_exceeds(body, self.max_depth):
            return _bad(f"Request body is nested deeper than {self.max_depth} levels.", "too_deep")
        for name in self.drop:
            body.pop(name, None)
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            return _bad("The 'model' field is required and must be a non-empty string.", "missing_model", "model")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            return _bad("The 'stream' field must be true or false.", "invalid_stream", "stream")
        ctx.body = body
        ctx.model = model
        return None

    @staticmethod
    def serialise(body: dict[str, Any]) -> bytes | Refusal:
        try:
            return orjson.dumps(body)
        except (orjson.JSONEncodeError, TypeError) as exc:
            # Lone surrogates from \\ud800-style escapes, or integers beyond 64 bits.
            reason = "invalid_unicode" if "str" in str(exc) or "surrogate" in str(exc) else "unencodable_value"
            return _bad("Request body contains a value that cannot be forwarded (an invalid Unicode escape or an integer out of range).", reason)


def _depth_exceeds(obj: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(obj, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > limit:
            return True
        if isinstance(node, dict):
            for v in node.values():
                if isinstance(v, (dict, list)):
                    push((v, depth + 1))
        else:
            for v in node:
                if isinstance(v, (dict, list)):
                    push((v, depth + 1))
    return False
