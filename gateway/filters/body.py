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
        self.drop_generate = tuple(n for n in self.drop if n != "input_ids")
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
        """Parse strictly into ctx.body and ctx.model; drop engine knobs.

        orjson is the one parser: it refuses invalid UTF-8, a BOM, NaN/Infinity, numbers that
        overflow to infinity, lone surrogates and control characters in strings. It keeps the last
        of duplicate keys, so duplicates are detected separately (see ``_maybe_duplicates``).
        """
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            msg = str(exc)
            if "UTF-8" in msg:
                return _bad("Request body is not valid UTF-8.", "invalid_utf8")
            if "depth" in msg:
                return _bad(f"Request body is nested deeper than {self.max_depth} levels.", "too_deep")
            return _bad(f"Request body is not valid JSON: {msg.split(':')[0][:120]}.", "invalid_json")
        if type(body) is not dict:
            return _bad("Request body must be a JSON object.", "not_an_object")
        shape = _shape(body, self.max_depth)
        if shape is None:
            return _bad(f"Request body is nested deeper than {self.max_depth} levels.", "too_deep")
        if _maybe_duplicates(raw, *shape):
            duplicate = _find_duplicate(raw)
            if duplicate is not None:
                return _bad(f"Duplicate key {duplicate[:64]!r} in the request body.", "duplicate_key")
        # /generate is lmdeploy's token-in route: input_ids is its input there, and only there.
        for name in self.drop if ctx.route.kind != "generate" else self.drop_generate:
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


def _shape(obj: dict[str, Any], limit: int) -> tuple[int, int] | None:
    """(object entries, colons inside strings) of a parsed body; None when nested deeper than limit."""
    entries = colons = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > limit:
            return None
        if type(node) is dict:
            entries += len(node)
            for k, v in node.items():
                colons += k.count(":")
                t = type(v)
                if t is str:
                    colons += v.count(":")
                elif t is dict or t is list:
                    push((v, depth + 1))
        else:
            for v in node:
                t = type(v)
                if t is str:
                    colons += v.count(":")
                elif t is dict or t is list:
                    push((v, depth + 1))
    return entries, colons


def _maybe_duplicates(raw: bytes, entries: int, colons: int) -> bool:
    """False only when the body certainly has no duplicate key.

    Every colon in valid JSON is either the separator of one object entry or inside a string,
    where it is written as ':' or as the escape \\u003a. So without duplicates
    ``raw colons == parsed entries + colons in parsed strings - escaped colons``. A duplicate key
    adds raw entries (and their colons) that the parsed object no longer has, so the left side
    grows; an over-counted escape (an escaped backslash before 'u003a') only shrinks the right.
    Any mismatch sends the body to the exact, slower check.
    """
    escaped = raw.count(b"\\u003a") + raw.count(b"\\u003A")
    return raw.count(b":") != entries + colons - escaped


def _find_duplicate(raw: bytes) -> str | None:
    try:
        _decoder.decode(raw.decode("utf-8"))
    except _DuplicateKey as exc:
        return str(exc)
    except (ValueError, RecursionError):
        pass
    return None
