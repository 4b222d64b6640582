"""CORS for browser clients: answer preflights for allowed origins, tag answers to them.

Configured once (``server.cors.allow_origins``: exact origins, or ``*``). A preflight is answered
before authentication because browsers send it without credentials; it reveals only which
methods and headers a route takes. An origin that is not allowed gets no CORS headers, and the
browser keeps the answer from the page.
"""

from __future__ import annotations

from ..config import CorsConfig
from ..routes import KNOWN_PATHS, ROUTES, lookup

ALLOW_HEADERS = b"authorization, content-type, x-api-key, anthropic-version, anthropic-beta, x-request-id, traceparent"
EXPOSE_HEADERS = b"x-request-id, request-id, retry-after"


class CorsPolicy:
    def __init__(self, config: CorsConfig):
        self.any = "*" in config.allow_origins
        self.origins = frozenset(o.encode() for o in config.allow_origins if o != "*")
        self.max_age = str(config.max_age).encode()

    def allows(self, origin: bytes | None) -> bool:
        return origin is not None and (self.any or origin in self.origins)

    def response_headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        """Headers for an actual answer: none unless the origin is allowed."""
        if not self.allows(origin):
            return [(b"vary", b"origin")]
        return [(b"access-control-allow-origin", origin), (b"access-control-expose-headers", EXPOSE_HEADERS), (b"vary", b"origin")]  # type: ignore[list-item]

    def preflight(self, path: str, origin: bytes | None, requested_method: bytes | None) -> list[tuple[bytes, bytes]] | None:
        """Headers for a 204 preflight answer, or None when this is not a preflight we accept."""
        if not self.allows(origin) or requested_method is None or path not in KNOWN_PATHS and lookup("GET", path) is None:
            return None
        methods = sorted({m for (m, p) in ROUTES if p == path} or {"GET"})
        if requested_method.decode("latin-1") not in methods:
            return None
        return [
            (b"access-control-allow-origin", origin),  # type: ignore[list-item]
            (b"access-control-allow-methods", ", ".join(methods).encode()),
            (b"access-control-allow-headers", ALLOW_HEADERS),
            (b"access-control-max-age", self.max_age),
            (b"vary", b"origin"),
        ]
