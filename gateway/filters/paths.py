"""Path policy: only canonical request-targets, matched exactly against the route table.

Our routes are plain ASCII (letters, digits, ``/ _ - .``), so a canonical request-target contains
nothing else: no ``%`` escapes at all, no dot segments, no ``//``, no backslash, no ``;``
parameters, no control or non-ASCII bytes. Anything else is refused with 400 before any other
work, because URL libraries downstream (httpx, yarl) would "repair" it into a different path.
The raw bytes and uvicorn's decoded path must agree, and the route is looked up exactly.
"""

from __future__ import annotations

import re

from ..errors import Refusal
from ..routes import KNOWN_PATHS, ROUTES, Route, lookup

_CANONICAL = re.compile(rb"^(?:/[A-Za-z0-9_\-.~]+)+$|^/$")
_DOT_SEGMENT = re.compile(rb"/\.{1,2}(?:/|$)")

NOT_CANONICAL = Refusal(400, "The request path is not in canonical form.", "path_not_canonical", code="invalid_path")
NOT_FOUND = Refusal(404, "Not found.", "route_not_found", code="not_found")


def _method_not_allowed(path: str) -> Refusal:
    allow = ", ".join(sorted(m for (m, p) in ROUTES if p == path))
    return Refusal(405, "Method not allowed.", "method_not_allowed", code="method_not_allowed", headers=((b"allow", allow.encode()),))


class PathPolicy:
    """Decides, from the request line alone, which route a request is, or refuses it."""

    def resolve(self, method: str, raw_path: bytes, path: str) -> Route | Refusal:
        if not _CANONICAL.match(raw_path) or _DOT_SEGMENT.search(raw_path):
            return NOT_CANONICAL
        # With no escapes the decoded path must equal the raw one; if a server ever disagrees, refuse.
        if path.encode("latin-1", "replace") != raw_path:
            return NOT_CANONICAL
        route = lookup(method, path)
        if route is not None:
            return route
        if path in KNOWN_PATHS:
            return _method_not_allowed(path)
        return NOT_FOUND
