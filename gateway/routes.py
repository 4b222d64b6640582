"""The route table: the only paths the gateway answers, and the only paths it ever sends upstream.

The upstream URL is always ``backend.url + route.upstream_path``, a constant from this table,
never the client's path: URL libraries normalise dot segments and percent escapes on the way
out (httpx, yarl), so a client's path must never reach them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    kind: str  # what the body is: chat, completions, responses, messages, count_tokens; or a local handler
    style: str = "openai"  # error body shape: "openai" or "anthropic"
    forward: bool = True  # False: the gateway answers it itself
    auth: bool = True

    @property
    def upstream_path(self) -> str:
        return self.path


ROUTES: dict[tuple[str, str], Route] = {
    (r.method, r.path): r
    for r in (
        Route("POST", "/v1/chat/completions", "chat"),
        Route("POST", "/v1/completions", "completions"),
        Route("POST", "/v1/responses", "responses"),
        Route("POST", "/v1/messages", "messages", style="anthropic"),
        Route("POST", "/v1/messages/count_tokens", "count_tokens", style="anthropic"),
        Route("GET", "/v1/models", "models", forward=False),
        Route("GET", "/health", "health", forward=False, auth=False),
        Route("GET", "/ready", "ready", forward=False, auth=False),
        Route("GET", "/metrics", "metrics", forward=False),
    )
}

# Paths the table knows, for a 405 instead of a 404 when only the method is wrong.
KNOWN_PATHS: frozenset[str] = frozenset(p for _, p in ROUTES)

# GET /v1/models/{id}: the one route with a parameter; the id is the rest of the (canonical) path.
MODEL_PREFIX = "/v1/models/"
MODEL_ROUTE = Route("GET", MODEL_PREFIX + "{id}", "model", forward=False)


def lookup(method: str, path: str) -> Route | None:
    route = ROUTES.get((method, path))
    if route is None and path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX) and method in ("GET", "HEAD"):
        return MODEL_ROUTE
    if route is None and method == "HEAD":
        r = ROUTES.get(("GET", path))
        if r is not None and not r.forward:
            return r
    return route
