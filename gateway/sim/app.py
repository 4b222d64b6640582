"""The simulated api_server as one Starlette app: the route table, error rendering, lifespan.

The routes are the real server's (``lmdeploy/serve/openai/api_server.py``), plus ``/_sim/*``. Unknown paths answer like
FastAPI (``{"detail": "Not Found"}``) and are still recorded by the front door.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from . import admin, control, inference
from .config import SimConfig
from .errors import ApiError, api_error_response, json_response, style_of
from .front import FrontDoor
from .state import SimState
from .tokens import PromptError

Endpoint = Callable[[Request], Awaitable[Response]]


def route_table(config: SimConfig) -> list[tuple[str, str, Endpoint]]:
    table: list[tuple[str, str, Endpoint]] = [
        ("POST", "/v1/chat/completions", inference.chat_completions),
        ("POST", "/v1/completions", inference.completions),
        ("POST", "/v1/responses", inference.responses),
        ("POST", "/v1/messages", inference.messages),
        ("POST", "/v1/messages/count_tokens", inference.count_tokens),
        ("GET", "/v1/models", admin.models),
        ("GET", "/anthropic/v1/models", admin.anthropic_models),
        ("POST", "/v1/embeddings", inference.embeddings),
        ("POST", "/generate", inference.generate),
        ("POST", "/v1/encode", inference.encode_route),
        ("POST", "/pooling", inference.pooling),
        ("POST", "/get_ppl", inference.get_ppl),
        ("GET", "/health", admin.health),
        # admin: no separate credential in lmdeploy, and here they really act
        ("GET", "/terminate", admin.terminate),
        ("POST", "/sleep", admin.sleep),
        ("POST", "/wakeup", admin.wakeup),
        ("GET", "/is_sleeping", admin.is_sleeping),
        ("POST", "/update_weights", admin.update_weights),
        ("POST", "/init_weights_update_group", admin.weights_group),
        ("POST", "/update_weights_from_distributed", admin.weights_group),
        ("POST", "/destroy_weights_update_group", admin.weights_group),
        ("POST", "/abort_request", admin.abort_request),
        ("GET", "/distserve/engine_info", admin.distserve_engine_info),
        ("POST", "/distserve/p2p_initialize", admin.distserve_action),
        ("POST", "/distserve/p2p_connect", admin.distserve_action),
        ("POST", "/distserve/p2p_drop_connect", admin.distserve_action),
        ("POST", "/distserve/free_cache", admin.distserve_free_cache),
    ]
    if not config.disable_metrics:
        table.append(("GET", "/metrics", admin.metrics))
    if not config.disable_docs:
        table += [("GET", "/openapi.json", admin.openapi), ("GET", "/", admin.docs)]
    table += [
        ("GET", "/_sim/requests", control.list_requests),
        ("DELETE", "/_sim/requests", control.clear_requests),
        ("GET", "/_sim/stats", control.stats),
        ("POST", "/_sim/control", control.control),
    ]
    return table


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return api_error_response(style_of(request.url.path), exc)


async def _prompt_error(request: Request, exc: Exception) -> Response:
    return api_error_response(style_of(request.url.path), ApiError(400, str(exc), param=getattr(exc, "param", None)))


async def _http_error(request: Request, exc: Exception) -> Response:
    # FastAPI's shape for router misses: {"detail": "Not Found"} / {"detail": "Method Not Allowed"}.
    assert isinstance(exc, HTTPException)
    return json_response({"detail": exc.detail}, exc.status_code)


def build_app(config: SimConfig) -> Starlette:
    sim = SimState(config)
    table = route_table(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        sim.health.start(sim.now(), config.initializing_for)
        refresher = asyncio.get_running_loop().create_task(admin.metrics_refresher(sim))
        try:
            yield
        finally:
            refresher.cancel()
            sim.engine.abort_all()

    app = Starlette(
        routes=[Route(path, endpoint, methods=[method]) for method, path, endpoint in table],
        middleware=[
            Middleware(FrontDoor, sim=sim),
            # lmdeploy's default CORS policy: any origin.
            Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"]),
        ],
        exception_handlers={ApiError: _api_error, PromptError: _prompt_error, 404: _http_error, 405: _http_error},
        lifespan=lifespan,
    )
    app.state.sim = sim
    app.state.route_list = [(m, p) for m, p, _ in table if not p.startswith("/_sim/")]
    app.state.openapi = admin.openapi_document(app.state.route_list, "lmdeploy api_server (simulated)")
    return app
