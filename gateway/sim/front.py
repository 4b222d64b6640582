"""The simulator's front door: one pure ASGI layer that runs before routing.

In order, as the real server's middleware stack (sleeping gate, then auth) would see it:

1. record the request (all paths but ``/health``, ``/metrics`` and ``/_sim/*``), before auth and
   routing, so tests can prove what reached the backend, 404s and admin routes included;
2. apply an armed fault to an inference request (drop, hang, fail);
3. answer 503 on inference routes while the engine sleeps (lmdeploy's EngineSleepingMiddleware);
4. check the Bearer key when ``--api-keys`` is set (lmdeploy's AuthenticationMiddleware: every
   path but the ``/health``, ``/docs``, ``/redoc``, ``/nodes`` prefixes and OPTIONS).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .connection import cut_connection, wait_disconnect
from .errors import error_body, style_of
from .faults import DROP, FAIL, HANG, Failure
from .state import SimState

INFERENCE_ROUTES = frozenset(
    ("POST", p) for p in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/generate")
)
SIM_PREFIX = "/_sim/"
_UNRECORDED = frozenset({"/health", "/metrics"})
_AUTH_SKIP_PREFIXES = ("/health", "/docs", "/redoc", "/nodes", SIM_PREFIX)
_SLEEPING_BODY = orjson.dumps(
    {"error": "Engine is sleeping; call POST /wakeup before inference (e.g. tags=weights&tags=kv_cache)."}
)


class FrontDoor:
    def __init__(self, app: ASGIApp, sim: SimState) -> None:
        self.app = app
        self.sim = sim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path.startswith(SIM_PREFIX):
            await self.app(scope, receive, send)
            return
        sim = self.sim
        if path not in _UNRECORDED:
            body = await _read_body(receive)
            sim.recorder.record(scope, body)
            receive = _replay(body, receive)
        method: str = scope["method"]
        if (method, path) in INFERENCE_ROUTES:
            fault = sim.faults.take()
            if fault is not None:
                await _inject(fault[0], fault[1], scope, receive, send)
                return
            if sim.sleeping:
                await _send(send, 503, _SLEEPING_BODY)
                return
        if sim.auth_enabled and method != "OPTIONS" and not path.startswith(_AUTH_SKIP_PREFIXES) and not self._authorized(scope):
            await _send(send, 401, orjson.dumps(error_body(style_of(path), 401, "Unauthorized.")))
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and self.sim.key_matches(token)
        return False


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client left mid-body; record what came
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A receive that hands the buffered body out once, then waits on the real connection."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _inject(kind: str, failure: Failure | None, scope: Scope, receive: Receive, send: Send) -> None:
    if kind == DROP:
        await cut_connection(scope, receive)
    elif kind == HANG:
        await wait_disconnect(receive)  # never answer; uvicorn cancels us at shutdown if need be
    elif kind == FAIL and failure is not None:
        body = failure.body if failure.body is not None else error_body(style_of(scope["path"]), failure.status, "Simulated failure.")
        await _send(send, failure.status, orjson.dumps(body))


async def _send(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
