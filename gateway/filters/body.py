"""Body hygiene: JSON only, bounded in size and depth, parsed once and strictly.

The gateway forwards its own serialisation of what it validated, never the client's bytes, so a
backend cannot read something different from the same bytes (duplicate keys, odd escapes,
another encoding). Engine knobs that address sessions, caches or processors are removed.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import orjson

from ..config import LimitsConfig
from ..errors import Refusal
from . import RequestContext


# A JSON escape is a backslash and the character after it; removing every pair (left to right,
# which is how a parser pairs them) leaves each remaining '"' a string delimiter.
_ESCAPED_BACKSLASH = b"\\\\"
_ESCAPED_QUOTE = b'\\"'
_STRING = re.compile(rb'"[^"]*"')
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{},"')
_NESTING = tuple(1 if c in b"[{" else -1 for c in range(256))  # per bracket: one level in or out
# \u003a / \u003A is an escaped colon only when the backslashes before 'u' are odd in number.
_ESCAPED_COLON = re.compile(rb"(?<!\\)(\\+)u003[aA]")


def _bad(message: str, reason: str, param: str | None = None) -> Refusal:
    return Refusal(400, message, reason, param=param, code="invalid_request_body")


UNSUPPORTED_MEDIA_TYPE = Refusal(415, "Content-Type must be application/json.", "unsupported_media_type", code="unsupported_media_type")


class BodyPolicy:
    def __init__(self, cfg: LimitsConfig):
        self.max_bytes = cfg.max_body_bytes
        self.max_depth = cfg.max_json_depth
        self.max_values = cfg.max_json_values
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
        """Parse strictly into ctx.body and ctx.model; drop engine knobs.

        orjson is the one parser: it refuses invalid UTF-8, a BOM, NaN/Infinity, numbers that
        overflow to infinity, lone surrogates and control characters in strings. It keeps the last
        of duplicate keys, so duplicates are detected separately (see ``_has_duplicates``). Every
        check after the parse is a linear pass of C code over bytes: a 32 MB body of a million
        small objects costs about two ``orjson.loads`` of it, not a walk of its objects in Python.
        """
        shape = _structure(raw, self.max_depth, self.max_values)
        if shape == "too_deep":
            return _bad(f"Request body is nested deeper than {self.max_depth} levels.", "too_deep")
        if shape == "too_many_values":
            return _bad(f"Request body has more than {self.max_values} JSON values.", "too_many_values")
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
        if _has_duplicates(raw, body):
            return _bad("Duplicate key in the request body.", "duplicate_key")
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


def _structure(raw: bytes, max_depth: int, max_values: int) -> str | None:
    """"too_deep" or "too_many_values" when the text's shape breaks a cap, before it is parsed.

    Python objects cost ten times and more the bytes that spell them (a dict per ``{}``), so the
    count of values is capped before orjson builds them. Linear passes of C code over bytes: drop
    escapes, keep brackets, commas and quotes, drop the strings, then count and measure nesting.
    """
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets <= max_depth and brackets + raw.count(b",") < max_values:
        return None  # cannot break either cap even counting what is inside strings
    structure = raw.replace(_ESCAPED_BACKSLASH, b"").replace(_ESCAPED_QUOTE, b"").translate(None, _NOT_STRUCTURE)
    # Most strings are now "" (no structure inside): drop them at once. A "" that joins two
    # adjacent strings merges them, which leaves what is outside strings as it was.
    structure = structure.replace(b'""', b"")
    if b'"' in structure:
        structure = _STRING.sub(b"", structure)
    commas = structure.count(b",")
    nesting = structure.translate(None, b",")
    if len(nesting) // 2 + commas + 1 > max_values:  # every value but the first follows a comma or opens a container
        return "too_many_values"
    if len(nesting) > max_depth and max(itertools.accumulate(map(_NESTING.__getitem__, nesting))) > max_depth:
        return "too_deep"
    return None


def _has_duplicates(raw: bytes, body: Any) -> bool:
    """True exactly when the text has a duplicate key in some object (orjson keeps the last one).

    Every colon of valid JSON text is an entry separator, a ':' inside a string, or inside a
    string as the escape \\u003a. Our own serialisation has no escaped colons and no duplicates,
    so it has exactly (parsed entries + colons in parsed strings) colons. The client's text has
    the same count plus, for each duplicate, the dropped entry's colon and every colon inside the
    dropped value: equal counts mean no duplicate. All counting is done by C code over bytes.
    """
    colons = raw.count(b":")
    if b"u003" in raw:
        colons += sum(1 for m in _ESCAPED_COLON.finditer(raw) if len(m.group(1)) % 2 == 1)
    try:
        ours = orjson.dumps(body)
    except (orjson.JSONEncodeError, TypeError):
        return False  # not forwardable at all: serialise() refuses it with its own reason
    return colons != ours.count(b":")
