"""Reading a request the way lmdeploy's routes do: the simulator state, the JSON content type, the body."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from .errors import ApiError
from .state import SimState


def sim_of(request: Request) -> SimState:
    return request.app.state.sim


def require_json_type(request: Request) -> None:
    """lmdeploy's ``validate_json_request``: POST routes take ``application/json`` only."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed")


async def read_json(request: Request) -> dict[str, Any]:
    require_json_type(request)
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body
