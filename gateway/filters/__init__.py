"""The filter chain: each filter is configured once and decides once per request.

Header filters (path policy, auth, rate limit) run before the body is read, so an
unauthenticated client cannot make the gateway buffer a body. Body filters (JSON hygiene,
model access, media policy) run on the parsed body. A filter returns ``None`` to pass or a
``Refusal`` that the listener turns into the error response.
"""

from __future__ import annotations

from typing import Any

from ..config import ApiKeyConfig
from ..routes import Route


class RequestContext:
    """What the filters know about one request, filled in as it moves down the chain."""

    __slots__ = ("scope", "route", "headers", "key", "body", "model", "style", "admission", "request_id", "backend", "outcome", "refusal", "span")

    def __init__(self, scope: dict[str, Any], route: Route, headers: dict[bytes, bytes]):
        self.scope = scope
        self.route = route
        self.headers = headers  # lower-cased names; a repeated header is kept as b"\x00"-joined
        self.key: ApiKeyConfig | None = None
        self.body: dict[str, Any] | None = None
        self.model: str | None = None
        self.style = route.style
        self.admission: Any = None  # the state layer's Admission, while limits and usage apply
        # Filled in on the way for the access log and the trace: never the body or the key.
        self.request_id = ""
        self.backend: str | None = None  # the backend that answered (the last one tried)
        self.outcome: Any = None  # the router's Outcome of that attempt: TTFB, token counts
        self.refusal: str | None = None  # the reason of the refusal the client got, if any
        self.span: Any = None  # the request's trace span, when tracing is on
