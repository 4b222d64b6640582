"""The route table: the only paths the gateway answers, and the only paths it ever sends upstream.

The upstream URL is always ``backend.url + route.upstream_path``, a constant from this table,
never the client's path: URL libraries normalise dot segments and percent escapes on the way
out (httpx, yarl), so a client's path must never reach them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import Refusal


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    kind: str  # what the body is: chat, completions, responses, messages, count_tokens; or a local handler
    style: str = "openai"  # error body shape: "openai" or "anthropic"
    forward: bool = True  # False: the gateway answers it itself
    auth: bool = True
    extra: bool = False  # an api_server route beyond OpenAI/Anthropic: off unless the key and the model enable it

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
        # lmdeploy's own inference routes (serve/openai/endpoints/generate.py, auxiliary.py). Their
        # lmdeploy bodies carry no model; here the client names one, so the gateway can route it.
        Route("POST", "/generate", "generate", extra=True),
        Route("POST", "/pooling", "pooling", extra=True),
        Route("POST", "/v1/encode", "encode", extra=True),
        Route("POST", "/get_ppl", "get_ppl", extra=True),
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


# What a key may use when its `routes` is not set: the OpenAI/Anthropic inference routes.
DEFAULT_KEY_ROUTES: tuple[str, ...] = tuple(r.path for r in ROUTES.values() if r.forward and not r.extra)
# Every forwarded route a key (`auth.keys[].routes`) may list; the extra ones a model may enable.
KEY_ROUTE_CHOICES: tuple[str, ...] = tuple(r.path for r in ROUTES.values() if r.forward)
EXTRA_ROUTES: tuple[str, ...] = tuple(r.path for r in ROUTES.values() if r.extra)


def lookup(method: str, path: str) -> Route | None:
    route = ROUTES.get((method, path))
    if route is None and path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX) and method in ("GET", "HEAD"):
        return MODEL_ROUTE
    if route is None and method == "HEAD":
        r = ROUTES.get(("GET", path))
        if r is not None and not r.forward:
            return r
    return route


class RouteAccess:
    """Whether a key may use a route (``auth.keys[].routes``), and whether a model serves it (``models.<name>.routes``)."""

    def __init__(self, model_routes: dict[str, tuple[str, ...]] | None = None):
        self._model_routes = model_routes or {}

    @staticmethod
    def key_refusal(route: Route, key_routes: tuple[str, ...] | None) -> Refusal | None:
        allowed = DEFAULT_KEY_ROUTES if key_routes is None else key_routes
        if not route.forward or route.path in allowed:
            return None
        return Refusal(403, f"This API key may not use {route.path}.", "route_not_allowed_for_key", code="permission_denied")

    def model_refusal(self, route: Route, model: str) -> Refusal | None:
        if not route.extra or route.path in self._model_routes.get(model, ()):
            return None
        return Refusal(
            400, f"{route.path} is not enabled for the model {model[:128]!r}.", "route_not_enabled_for_model", param="model", code="route_not_enabled"
        )

