"""Health, metrics, model listings, docs and the admin routes; the admin routes really act.

They obey whoever calls them (past the api key, like lmdeploy, which has no separate admin
credential), so a test can prove a gateway keeps them out: ``/terminate`` stops the process,
``/sleep`` makes inference answer 503, ``/abort_request`` aborts engine work.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from .errors import ApiError, json_response
from .inference import read_json, require_json_type, sim_of
from .state import SimState

_TERMINATE_DELAY_S = 0.05  # lets the 200 reach the client before the graceful shutdown starts


async def health(request: Request) -> Response:
    code, body = sim_of(request).health_snapshot()
    return json_response(body, code)


async def metrics(request: Request) -> Response:
    sim = sim_of(request)
    if sim.config.metrics_interval <= 0:
        sim.metrics.refresh(sim.engine)
    return Response(sim.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def metrics_refresher(sim: SimState) -> None:
    """lmdeploy's ``_force_log`` loop: the gauges change only on this beat."""
    interval = sim.config.metrics_interval
    while True:
        sim.metrics.refresh(sim.engine)
        if interval <= 0:
            return  # refreshed on every scrape instead
        await asyncio.sleep(interval)


async def models(request: Request) -> Response:
    sim = sim_of(request)
    created = int(sim.started_at)
    main = sim.models[0]
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "lmdeploy",
            "root": main,
            "parent": None if name == main else main,
            "permission": [
                {
                    "id": f"modelperm-{i}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": True,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        for i, name in enumerate(sim.models)
    ]
    return json_response({"object": "list", "data": data})


async def anthropic_models(request: Request) -> Response:
    sim = sim_of(request)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(sim.started_at))
    data = [{"type": "model", "id": m, "display_name": m, "created_at": created} for m in sim.models]
    return json_response({"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]})


async def terminate(request: Request) -> Response:
    if not sim_of(request).config.allow_terminate_by_client:
        raise ApiError(400, "The server can not be terminated. Please add --allow-terminate-by-client when start the server.")
    return Response(status_code=200, background=BackgroundTask(_sigterm_soon))


async def _sigterm_soon() -> None:
    # SIGTERM, not an exit: uvicorn shuts down gracefully and in-flight requests finish, as in lmdeploy.
    asyncio.get_running_loop().call_later(_TERMINATE_DELAY_S, os.kill, os.getpid(), signal.SIGTERM)


async def sleep(request: Request) -> Response:
    require_json_type(request)
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise ApiError(400, 'The "level" query parameter must be 1 or 2.')
    sim = sim_of(request)
    sim.sleep_level = int(level)
    sim.health.set("sleeping")
    return Response(status_code=200)


async def wakeup(request: Request) -> Response:
    require_json_type(request)
    sim = sim_of(request)
    sim.sleep_level = 0
    sim.health.set("healthy")
    return Response(status_code=200)


async def is_sleeping(request: Request) -> Response:
    return json_response({"is_sleeping": sim_of(request).sleeping})


async def update_weights(request: Request) -> Response:
    await read_json(request)
    sim = sim_of(request)
    sim.engine.reset_cache()  # new weights make every cached KV block stale
    return json_response(None)


async def weights_group(request: Request) -> Response:
    """/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group."""
    await read_json(request)
    sim = sim_of(request)
    if sim.config.backend != "pytorch":
        raise ApiError(501, f'Disaggregated weight-update endpoints require backend="pytorch", got {sim.config.backend!r}.')
    if request.url.path == "/update_weights_from_distributed":
        sim.engine.reset_cache()
    return json_response({"success": True, "message": "Succeeded (simulated)."})


async def abort_request(request: Request) -> Response:
    sim = sim_of(request)
    if not sim.config.enable_abort_handling:
        return Response("This server does not support abort requests. Enable with --enable-abort-handling flag.", status_code=501)
    body = await read_json(request)
    if body.get("abort_all"):
        sim.engine.abort_all()
        return Response(status_code=200)
    session_id = body.get("session_id")
    seq = sim.engine.find_session(session_id) if isinstance(session_id, int) else None
    if seq is None:
        raise ApiError(400, f"Session {session_id} not found.")
    # Every sequence of the session (a chat `n` fan-out shares one id).
    while seq is not None:
        sim.engine.abort(seq)
        seq = sim.engine.find_session(session_id)
    return Response(status_code=200)


# -- docs ---------------------------------------------------------------------------------------


def openapi_document(routes: list[tuple[str, str]], title: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes:
        paths.setdefault(path, {})[method.lower()] = {"responses": {"200": {"description": "Successful Response"}}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": "0.0.0"}, "paths": paths}


async def openapi(request: Request) -> Response:
    return json_response(request.app.state.openapi)


async def docs(request: Request) -> Response:
    items = "".join(f"<li><code>{m} {p}</code></li>" for m, p in request.app.state.route_list)
    return HTMLResponse(f"<!doctype html><title>lmdeploy api_server (simulated)</title><h1>Routes</h1><ul>{items}</ul>")
