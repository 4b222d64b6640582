"""The admin listener: its own port (127.0.0.1 by default) and its own key.

    GET    /status                         the live status page (HTML; holds no data itself)
    GET    /admin/status                   what the page polls: backends, refusals, series
    GET    /admin/backends                 backends with live figures
    POST   /admin/backends                 add a remote backend {url, name, api_key, models}
    DELETE /admin/backends/{id}            remove a remote backend
    POST   /admin/backends/{id}/drain      no new requests; in-flight ones finish
    POST   /admin/backends/{id}/undrain
    POST   /admin/backends/{id}/restart    a launched instance only
    POST   /admin/reload                   re-read the config file; apply what may change live
    GET    /admin/usage?key=sha256:…&since=T  usage per key and model (the store's: memory or Redis);
                                           key and since (unix seconds) are optional
    GET    /admin/balancer                 what the balancer and the gateway queue have learnt (speeds,
                                           batch slots, KV capacity, the queue's rate) and the last
                                           /metrics poll of each backend
    GET    /metrics                        Prometheus text

Every route but ``/status`` needs ``Authorization: Bearer <admin key>``; the admin key is not an
API key and no API key opens this port. Nothing here is in the public route table.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from urllib.parse import parse_qs
from importlib import resources
from typing import Any, Awaitable, Callable

import orjson

from ..config import ConfigError
from ..config.core import validate_backend_url
from ..config.fields import Problems, Section
from ..errors import Refusal
from ..responses import Receive, Scope, Send, refuse, send_json
from ..routing.pool import Backend, BackendPool
from .reload import ReloadRefused
from .stats import LiveStats

MAX_BODY = 64 * 1024
_BACKEND_PATH = re.compile(r"^/admin/backends/([A-Za-z0-9._#:\-]{1,128})(?:/(drain|undrain|restart))?$")
_NAME = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")
_KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")

UNAUTHORIZED = Refusal(401, "This needs the admin key: Authorization: Bearer <admin key>.", "admin_unauthorized", code="invalid_admin_key")
NOT_FOUND = Refusal(404, "Not found.", "route_not_found", code="not_found")
NO_BACKEND = Refusal(404, "No backend with that id.", "backend_not_found", code="backend_not_found")
METHOD = Refusal(405, "Method not allowed.", "method_not_allowed", code="method_not_allowed")
TOO_LARGE = Refusal(413, f"The body is larger than {MAX_BODY} bytes.", "body_too_large", code="body_too_large")


def _bad(message: str, reason: str = "invalid_request") -> Refusal:
    return Refusal(400, message, reason)


def _conflict(message: str, reason: str) -> Refusal:
    return Refusal(409, message, reason, code=reason)


class AdminApp:
    def __init__(
        self,
        *,
        key_hash: str,
        pool: BackendPool,
        stats: LiveStats,
        metrics: Callable[[], bytes],
        reload: Callable[[], Awaitable[list[str]]],
        launcher: Callable[[], Any],
        usage: Callable[[str | None, float | None], Awaitable[list[Any]]] | None = None,
        key_names: Callable[[], dict[str, str]] | None = None,
        balancer: Callable[[], dict[str, Any]] | None = None,
    ):
        self._key = key_hash.encode()
        self.pool = pool
        self.stats = stats
        self.metrics = metrics
        self.reload = reload
        self.launcher = launcher  # the Launcher, or None when nothing is launched
        self.usage = usage  # the state store's usage(key_hash, since) -> [UsageRow]
        self.key_names = key_names or dict  # key hash -> name, for the rows
        self.balancer = balancer or dict  # what the balancer and the queue have learnt
        self.page = resources.files(__package__).joinpath("status.html").read_bytes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path == "/status" and method == "GET":
            return await _send(send, 200, self.page, b"text/html; charset=utf-8", [(b"cache-control", b"no-store")])
        if not self._authorised(scope):
            await refuse(send, UNAUTHORIZED)
            return
        try:
            await self._route(method, path, scope, receive, send)
        except _Refused as r:
            await refuse(send, r.refusal)

    def _authorised(self, scope: Scope) -> bool:
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(values) != 1 or not values[0].startswith(b"Bearer "):
            return False
        digest = b"sha256:" + hashlib.sha256(values[0][7:].strip()).hexdigest().encode()
        return hmac.compare_digest(digest, self._key)

    async def _route(self, method: str, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        if path == "/admin/status":
            _only(method, "GET")
            return await send_json(send, 200, self.snapshot())
        if path == "/admin/backends":
            if method == "GET":
                return await send_json(send, 200, {"backends": self.backends()})
            _only(method, "POST")
            return await self._add(await _read_json(receive), send)
        if path == "/admin/reload":
            _only(method, "POST")
            return await self._reload(send)
        if path == "/admin/usage":
            _only(method, "GET")
            return await self._usage(scope, send)
        if path == "/admin/balancer":
            _only(method, "GET")
            return await send_json(send, 200, self.balancer())
        if path == "/metrics":
            _only(method, "GET")
            return await _send(send, 200, self.metrics(), b"text/plain; version=0.0.4")
        m = _BACKEND_PATH.match(path)
        if m is None:
            raise _Refused(NOT_FOUND)
        backend = self.pool.get(m.group(1))
        if backend is None:
            raise _Refused(NO_BACKEND)
        action = m.group(2)
        if action is None:
            _only(method, "DELETE")
            return await self._remove(backend, send)
        _only(method, "POST")
        if action in ("drain", "undrain"):
            self.pool.set_draining(backend, action == "drain")
            return await send_json(send, 200, self._row(backend, time.monotonic()))
        return await self._restart(backend, send)

    # -- views -------------------------------------------------------------------------------------
    def backends(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [self._row(b, now) for b in sorted(self.pool, key=lambda b: b.id)]

    def _row(self, b: Backend, now: float) -> dict[str, Any]:
        launched = self._instances().get(b.id, {})
        return {
            "id": b.id,
            "url": b.url,
            "origin": b.origin,
            "models": sorted(b.models),
            "healthy": b.healthy,
            "health": b.health_status,
            "available": b.available(now),
            "draining": b.draining,
            "ejected_for_s": round(max(0.0, b.ejected_until - now), 1),
            "in_flight": b.in_flight,
            "restarts": launched.get("restarts", 0),
            "state": launched.get("state"),
            **self.stats.backend(b.id),
        }

    def _instances(self) -> dict[str, dict[str, Any]]:
        launcher = self.launcher()
        if launcher is None:
            return {}
        return {row["id"]: row for row in launcher.status()["instances"]}

    def snapshot(self) -> dict[str, Any]:
        return {
            "at": time.time(),
            "backends": self.backends(),
            "refusals": {"by_reason": dict(sorted(self.stats.refusal_counts.items())), "recent": self.stats.recent_refusals()},
            "series": self.stats.series(60),
            "requests_total": self.stats.total,
        }

    async def _usage(self, scope: Scope, send: Send) -> None:
        if self.usage is None:
            raise _Refused(NOT_FOUND)
        try:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"), max_num_fields=8)
        except ValueError:  # more fields than that
            raise _Refused(_bad("too many query fields: key and since only", "invalid_usage_query")) from None
        key = (query.get("key") or [None])[0]
        since_text = (query.get("since") or [None])[0]
        if key is not None and not _KEY_HASH.match(key):
            raise _Refused(_bad("key: give the key's hash, sha256: and 64 lowercase hex digits (gateway usage resolves names)", "invalid_usage_query"))
        since = None
        if since_text is not None:
            try:
                since = float(since_text)
            except ValueError:
                since = -1.0
            if not 0 <= since < 1e11:
                raise _Refused(_bad("since: give unix seconds", "invalid_usage_query"))
        try:
            rows = await self.usage(key, since)
        except Exception as exc:  # Redis unreachable: the store's own timeout has passed
            raise _Refused(Refusal(503, f"usage could not be read from the state store ({exc.__class__.__name__})", "usage_unavailable", code="usage_unavailable")) from None
        names = self.key_names()
        await send_json(send, 200, {"usage": [
            {"key": names.get(r.key_hash, "?"), "key_hash": r.key_hash, "model": r.model, "requests": r.requests,
             "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens, "estimated_requests": r.estimated}
            for r in rows
        ]})

    # -- actions -----------------------------------------------------------------------------------
    async def _add(self, data: Any, send: Send) -> None:
        problems = Problems()
        s = Section(data, "backend", problems)
        url = s.str("url")
        name = s.str("name", None)
        api_key = s.str("api_key", None)
        models = s.str_list("models", None)
        s.finish()
        base = validate_backend_url(url, s, "url") if isinstance(url, str) else None
        if problems or base is None:
            raise _Refused(_bad("; ".join(problems.items) if problems else "backend.url: required", "invalid_backend"))
        if name is not None and not _NAME.match(name):
            raise _Refused(_bad(f"backend.name: {name[:64]!r} may use only letters, digits and . _ : -", "invalid_backend"))
        if any(b.url == base for b in self.pool):
            raise _Refused(_conflict(f"a backend with url {base} is already in the pool", "backend_exists"))
        backend_id = name or f"admin-{len(self.pool)}"
        if self.pool.get(backend_id) is not None:
            raise _Refused(_conflict(f"a backend named {backend_id!r} is already in the pool", "backend_exists"))
        backend = Backend(
            id=backend_id, url=base, api_key=api_key, models=frozenset(models or ()), static_models=models is not None, origin="admin"
        )
        self.pool.add(backend)
        await self.pool.check(backend)  # joins the rotation now if it is healthy
        await send_json(send, 201, self._row(backend, time.monotonic()))

    async def _remove(self, backend: Backend, send: Send) -> None:
        if backend.origin == "launched":
            raise _Refused(_conflict("a launched instance cannot be removed; drain it, or change `launch:` and restart", "backend_launched"))
        self.pool.remove(backend.id)
        self.stats.forget(backend.id)
        await send_json(send, 200, {"removed": backend.id})

    async def _restart(self, backend: Backend, send: Send) -> None:
        launcher = self.launcher()
        if backend.origin != "launched" or launcher is None:
            raise _Refused(_conflict("only launched instances can be restarted; the gateway does not run remote backends", "backend_not_launched"))
        if not await launcher.restart(backend.id):
            raise _Refused(_conflict("the launcher is stopping", "launcher_stopping"))
        await send_json(send, 202, {"restarting": backend.id})

    async def _reload(self, send: Send) -> None:
        try:
            applied = await self.reload()
        except ConfigError as exc:
            raise _Refused(_bad("the config file has problems; nothing was applied: " + "; ".join(exc.problems), "config_invalid")) from None
        except ReloadRefused as exc:
            await send_json(send, 409, {"error": {"message": str(exc), "type": "invalid_request_error", "param": None, "code": "reload_refused"}, "fields": exc.fields})
            return
        await send_json(send, 200, {"applied": applied})


class _Refused(Exception):
    def __init__(self, refusal: Refusal):
        self.refusal = refusal


def _only(method: str, allowed: str) -> None:
    if method != allowed:
        raise _Refused(METHOD)


async def _read_json(receive: Receive) -> Any:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _Refused(_bad("the client went away"))
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise _Refused(TOO_LARGE)
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    try:
        return orjson.loads(b"".join(parts))
    except orjson.JSONDecodeError:
        raise _Refused(_bad("The body is not valid JSON.", "invalid_json")) from None


async def _send(send: Send, status: int, body: bytes, content_type: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
