"""The router: pick a backend for a validated request, forward it, relay the answer.

Retries are safe only before the client has seen a byte: a refused or reset connection, or a
502/503 from the backend, is retried on another backend (bounded by ``balancer.retries``). Once
a response has started, it is relayed as it is; a stream that breaks ends with an error event.
The balancer is told about every dispatch exactly once (``completed``), whatever happens,
including the client going away.

Backends are untrusted: an answer that breaks the protocol or a limit (``UpstreamInvalid``) is a
502 of our own, and a backend's 5xx body (which may hold a traceback or an internal address) is
replaced by our own error with the same status; the original goes to the log, truncated and
escaped.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable

import orjson

from .. import metrics, tracing
from ..errors import Refusal, model_not_found, sse_error_event
from ..leanmetrics import HistogramChild
from ..filters import RequestContext
from ..upstream import Upstream, UpstreamFailure, UpstreamInvalid, UpstreamResponse, UpstreamTimeout
from ..config.balancer import DEFAULT_PRIORITY
from .policies import Balancer, Outcome, RequestInfo
from .queue import GatewayQueue
from ..routes import RouteAccess
from .pool import Backend, BackendPool

log = logging.getLogger("gateway.router")

Send = Callable[[dict[str, Any]], Awaitable[None]]

RETRYABLE_STATUS = (502, 503)


NO_BACKEND = Refusal(503, "No healthy backend is available for this model; try again shortly.", "no_healthy_backend", code="service_unavailable")
UPSTREAM_FAILED = Refusal(502, "The backend could not be reached.", "upstream_unreachable", code="bad_gateway")
INVALID_RESPONSE = Refusal(502, "The backend sent an invalid response.", "upstream_invalid_response", code="bad_gateway")
TOO_LARGE = Refusal(502, "The backend's response was larger than this gateway accepts.", "upstream_response_too_large", code="bad_gateway")
LOGGED_ERROR_BYTES = 2048  # of a backend's 5xx body, for the operator's log


def backend_error(status: int, retry_after: bytes | None) -> Refusal:
    """Our own error for a backend's 5xx: the status is kept, the backend's words are not."""
    headers = ((b"retry-after", retry_after),) if retry_after is not None else ()
    return Refusal(status, f"The backend failed to answer (HTTP {status}).", "upstream_error", code="upstream_error", headers=headers)


TIMEOUTS = {
    "connect": Refusal(504, "Timed out connecting to the backend.", "upstream_connect_timeout", code="gateway_timeout"),
    "first_byte": Refusal(504, "The backend did not start answering in time.", "upstream_first_byte_timeout", code="gateway_timeout"),
    "idle": Refusal(504, "The backend stopped answering mid-response.", "upstream_idle_timeout", code="gateway_timeout"),
}


async def refuse_invalid(pool: BackendPool, b: Backend, exc: UpstreamInvalid, reply: Callable[[Refusal], Awaitable[None]]) -> int:
    """A backend that broke the protocol (framing, size, status) is answered for with our own 502."""
    pool.report_failure(b)
    metrics.UPSTREAM_ERRORS.labels(backend=b.id, kind=f"invalid_{exc.reason}").inc()
    log.warning("backend %s sent an invalid response (%s)", b.id, exc.reason)
    refusal = TOO_LARGE if exc.reason == "body_too_large" else INVALID_RESPONSE
    await reply(refusal)
    return refusal.status


async def open_upstream(
    upstream: Upstream,
    pool: BackendPool,
    b: Backend,
    path: str,
    payload: bytes,
    headers: list[tuple[bytes, bytes]],
    reply: Callable[[Refusal], Awaitable[None]],
    last: bool,
) -> UpstreamResponse | int | None:
    """Open one request to ``b``; failures are told to the pool and the metrics the same way for
    every caller (the router, both phases of prefill/decode). Returns the response, the status the
    client was already answered with (a timeout, an invalid answer, the last attempt's failure), or
    None: nothing reached the client, try another backend."""
    try:
        return await upstream.open(b.url + path, payload, headers + b.auth_headers())
    except UpstreamTimeout as exc:
        pool.report_failure(b)
        metrics.UPSTREAM_ERRORS.labels(backend=b.id, kind=f"{exc.phase}_timeout").inc()
        await reply(TIMEOUTS[exc.phase])
        return TIMEOUTS[exc.phase].status
    except UpstreamInvalid as exc:
        # Not retried: a misbehaving backend is answered for, not hidden behind another try.
        return await refuse_invalid(pool, b, exc, reply)
    except UpstreamFailure as exc:
        metrics.UPSTREAM_ERRORS.labels(backend=b.id, kind=exc.kind).inc()
        if exc.kind == "connect_refused":
            pool.report_unreachable(b)
        else:
            pool.report_failure(b)
        log.warning("backend %s failed before answering (%s)", b.id, exc.kind)
        if last:
            await reply(UPSTREAM_FAILED)
            return UPSTREAM_FAILED.status
        return None



async def queued_pick(queue: GatewayQueue, ctx: RequestContext, req: Any, candidates: int, reply: Callable[[Refusal], Awaitable[None]]) -> Backend | int:
    """Wait in the gateway queue for a backend (picked and dispatched there) on behalf of ctx's key;
    a refusal is sent and its status returned. The hybrid router and the PD prefill phase share it."""
    key = ctx.key
    with tracing.child(ctx, "pick", candidates=candidates, queued=True):
        admitted = await queue.acquire(req, key.name if key else "", key.priority if key else DEFAULT_PRIORITY)
    if isinstance(admitted, Refusal):
        await reply(admitted)
        return admitted.status
    return admitted

class Router:
    def __init__(self, pool: BackendPool, balancer: Balancer, upstream: Upstream, retries: int = 1):
        self.pool = pool
        self.balancer = balancer
        self.upstream = upstream
        self.retries = retries
        self._ttfb: dict[str, HistogramChild] = {}
        self.access = RouteAccess()  # extra routes (/generate, ...) per model; set from config by the Gateway
        self.disagg: Any = None  # routing.disagg.PDDispatcher when a model is served with serving: distserve
        self.queue: GatewayQueue | None = None  # late binding, priorities and shedding; set by the Gateway

    def _first_byte(self, b: Backend, req: RequestInfo, kind: str, ttft: float) -> None:
        """The response started: the policy learns from it, and the TTFB histogram records it."""
        if self.balancer.first_byte(b, req, ttft) and self.queue is not None:
            self.queue.wake(req.model)  # it joined the batch at once: the backend had room the policy had not counted
        self._observe_ttfb(kind, ttft)

    def _observe_ttfb(self, kind: str, seconds: float) -> None:
        child = self._ttfb.get(kind)
        if child is None:
            child = self._ttfb[kind] = metrics.TTFB.labels(route=kind)
        child.observe(seconds)

    async def forward(
        self,
        ctx: RequestContext,
        payload: bytes,
        headers: list[tuple[bytes, bytes]],
        send: Send,
        reply: Callable[[Refusal], Awaitable[None]],
    ) -> int:
        """Forward one request and relay the response; returns the status sent to the client."""
        model = ctx.model or ""
        refusal = self.access.model_refusal(ctx.route, model)
        if refusal is not None:
            await reply(refusal)
            return refusal.status
        if self.disagg is not None and self.disagg.serves(model):  # prefill/decode disaggregation: two phases
            return await self.disagg.forward(ctx, headers, send, reply)
        req = self.balancer.describe(model, ctx.body or {})
        path = ctx.route.upstream_path
        tried: set[str] = set()
        attempts = 1 + self.retries
        for attempt in range(attempts):
            candidates = self.pool.eligible(model)
            if tried:
                candidates = [b for b in candidates if b.id not in tried] or candidates
            if not candidates:
                refusal = NO_BACKEND if self.pool.knows_model(model) else model_not_found(model)
                await reply(refusal)
                return refusal.status
            if attempt == 0 and self.queue is not None:
                # The queue binds the request to a backend (picked and dispatched) when one has room.
                admitted = await queued_pick(self.queue, ctx, req, len(candidates), reply)
                if isinstance(admitted, int):
                    return admitted
                backend = admitted
            else:
                with tracing.child(ctx, "pick", candidates=len(candidates)):
                    backend = self.balancer.pick(candidates, req)
                self.balancer.dispatched(backend, req)
            last = attempt == attempts - 1
            status = await self._attempt(backend, req, ctx, path, payload, headers, send, reply, last)
            if status is not None:
                return status
            tried.add(backend.id)
            metrics.RETRIES.labels(reason="before_first_byte").inc()
        raise AssertionError("unreachable: the last attempt always answers")

    async def _attempt(
        self,
        b: Backend,
        req: RequestInfo,
        ctx: RequestContext,
        path: str,
        payload: bytes,
        headers: list[tuple[bytes, bytes]],
        send: Send,
        reply: Callable[[Refusal], Awaitable[None]],
        last: bool,
    ) -> int | None:
        """One try on one backend. None means: nothing reached the client, try another."""
        start = time.monotonic()
        outcome = Outcome(status=0, ok=False)
        try:
            if ctx.span is None:  # untraced: no context manager to build
                response = await open_upstream(self.upstream, self.pool, b, path, payload, headers, reply, last)
            else:
                with tracing.upstream_call(ctx, b.id, headers) as traced:
                    response = await open_upstream(self.upstream, self.pool, b, path, payload, traced, reply, last)
            if not isinstance(response, UpstreamResponse):
                return response  # the status the client got, or None: try another backend
            try:
                outcome.status = response.status
                if response.status >= 500:
                    self.pool.report_failure(b)
                    metrics.UPSTREAM_ERRORS.labels(backend=b.id, kind=f"http_{response.status}").inc()
                else:
                    self.pool.report_success(b)
                if response.status in RETRYABLE_STATUS and not last:
                    return None
                if response.status >= 500:
                    await self._replace_error(b, response, reply)
                elif response.status == 200 and response.is_event_stream:
                    await self._relay_stream(b, req, ctx, response, send, start, outcome)
                else:
                    return await self._relay_whole(b, req, ctx.route.kind, response, send, start, outcome, reply)
                return response.status
            finally:
                await response.aclose()
        finally:
            self.balancer.completed(b, req, outcome)
            if self.queue is not None:
                self.queue.completed(req.model)
            ctx.backend, ctx.outcome = b.id, outcome  # for the access log, the trace and the state layer's settling

    async def _relay_whole(
        self,
        b: Backend,
        req: RequestInfo,
        kind: str,
        response: UpstreamResponse,
        send: Send,
        start: float,
        outcome: Outcome,
        reply: Callable[[Refusal], Awaitable[None]],
    ) -> int:
        """Read the whole body and send it; returns the status the client got (ours if reading failed)."""
        try:
            body = await self.upstream.read_all(response)
        except UpstreamTimeout as exc:
            self.pool.report_failure(b)
            await reply(TIMEOUTS[exc.phase])
            return TIMEOUTS[exc.phase].status
        except UpstreamInvalid as exc:
            return await refuse_invalid(self.pool, b, exc, reply)
        except UpstreamFailure:
            self.pool.report_failure(b)
            await reply(UPSTREAM_FAILED)
            return UPSTREAM_FAILED.status
        outcome.ttft = time.monotonic() - start
        self._first_byte(b, req, kind, outcome.ttft)
        if response.status == 200:
            outcome.ok = True
            _read_usage(body, outcome, b.id)
        hdrs = list(response.headers)
        hdrs.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": response.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return response.status

    async def _replace_error(self, b: Backend, response: UpstreamResponse, reply: Callable[[Refusal], Awaitable[None]]) -> None:
        """A backend 5xx: log (the start of) its body, answer with our own error of the same status."""
        try:
            original = await self.upstream.read_some(response, LOGGED_ERROR_BYTES)
        except (UpstreamTimeout, UpstreamFailure):
            original = b""
        # repr() escapes control characters: the backend cannot forge log lines.
        log.warning("backend %s answered %d: %s", b.id, response.status, repr(original[:LOGGED_ERROR_BYTES])[:LOGGED_ERROR_BYTES * 4])
        retry_after = next((v for k, v in response.headers if k == b"retry-after"), None)
        if retry_after is not None and (len(retry_after) > 32 or not retry_after.strip().isdigit()):
            retry_after = None  # only delay-seconds: a date or anything else is not passed on
        await reply(backend_error(response.status, retry_after))

    async def _relay_stream(
        self,
        b: Backend,
        req: RequestInfo,
        ctx: RequestContext,
        response: UpstreamResponse,
        send: Send,
        start: float,
        outcome: Outcome,
    ) -> None:
        hdrs = list(response.headers)
        hdrs += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        await send({"type": "http.response.start", "status": 200, "headers": hdrs})
        scan = SseScan(first=ctx.route.style == "anthropic")
        slow = True  # the first read, or a line carried from the last one
        events = 0  # the inline reads' data: fields (scan.events has the others')
        try:
            async for chunk in response.chunks():
                # A read that ends a line and follows one that did: scanned inline (a call per
                # chunk costs more than the scans). Any other goes through scan.read(). find(),
                # not "in": bytes.__contains__ first tries its argument as an int (a TypeError
                # raised and cleared), about 100 ns a chunk.
                if slow or chunk[-1:] != b"\n":
                    if outcome.ttft is None:
                        outcome.ttft = time.monotonic() - start
                        self._first_byte(b, req, ctx.route.kind, outcome.ttft)
                    slow = scan.read(chunk)
                else:
                    if chunk.find(b'"usage"') >= 0:
                        scan.usage = chunk
                    events += chunk.count(b"data:")
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (UpstreamTimeout, UpstreamFailure) as exc:
            if isinstance(exc, UpstreamTimeout):
                kind = f"{exc.phase}_timeout"
            else:
                kind = f"invalid_{exc.reason}" if isinstance(exc, UpstreamInvalid) else "stream_broken"
            metrics.UPSTREAM_ERRORS.labels(backend=b.id, kind=kind).inc()
            self.pool.report_failure(b)
            log.warning("stream from backend %s broke mid-way (%s)", b.id, kind)
            event = sse_error_event("The backend stopped answering before the response was complete.", ctx.style)
            await send({"type": "http.response.body", "body": event, "more_body": False})
            return
        outcome.ok = True
        scan.finish(outcome, b.id)
        events += scan.events
        if outcome.completion_tokens is None and events:
            # No usage (an OpenAI stream without stream_options.include_usage): about one token per
            # event, less the role chunk and [DONE]. An estimate, but better than nothing to learn from.
            outcome.completion_tokens = max(1, events - 2)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class SseScan:
    """What a stream tells the gateway as it passes: its last complete lines that hold a usage
    object and its number of ``data:`` fields (the completion estimate without usage).

    A read may end inside a line (a frame, a ``data:`` or the ``"usage"`` key cut in two). That
    line is carried, in pieces joined once when its newline comes, and looked at then: each line is
    scanned once and whole, whatever the reads. The carry is at most one line, which the upstream
    layer already bounds (``LineBound``: a longer one ends the stream before it gets here).

    ``first``: also keep the lines of the first usage (an Anthropic stream's ``message_start``,
    the only one with the input tokens; the ``message_delta`` at the end has the output tokens).
    ``read()`` then asks for every read until it has them, so the caller's inline scan never
    misses them; message_start is the first event, so that is a read or two.
    ``watch``: also note lmdeploy's in-stream error event (``error``) and a ``[DONE]`` not
    after one (``done``), the disaggregated decode's end of stream.
    """

    __slots__ = ("events", "usage", "carry", "first", "want_first", "watch", "error", "done")

    def __init__(self, *, first: bool = False, watch: bool = False) -> None:
        self.events = 0
        self.usage = b""  # complete lines, the last of which with "usage" is read at the end
        self.carry: list[bytes] = []  # the start of a line the last read ended in
        self.first = b""  # with first=True: the complete lines that held the first "usage"
        self.want_first = first
        self.watch = watch
        self.error = False
        self.done = False

    def read(self, chunk: bytes) -> bool:
        """Scan one read's complete lines; True while a line is carried to the next read (or the
        first usage is still wanted). A read that ends a line, when False was returned, may instead
        be scanned by the caller as it is: ``"usage"`` in it makes it ``usage``; its ``data:``
        fields are the caller's to count."""
        carry = self.carry
        start = 0
        if carry:
            nl = chunk.find(b"\n")
            if nl < 0:
                carry.append(chunk)
                return True
            carry.append(chunk[: nl + 1])
            self._line(b"".join(carry))
            carry.clear()
            start = nl + 1
        end = chunk.rfind(b"\n", start) + 1  # after the last newline; 0 when there is none
        if end < len(chunk):
            carry.append(chunk[max(start, end):])
        if end > start:
            self.events += chunk.count(b"data:", start, end)
            if chunk.find(b'"usage"', start, end) >= 0:
                self.usage = chunk[start:end]
                if self.want_first:
                    self.first, self.want_first = self.usage, False
            if self.watch:
                self._watch(chunk, start, end)
        return bool(carry) or self.want_first

    def _line(self, line: bytes) -> None:
        self.events += line.count(b"data:")
        if line.find(b'"usage"') >= 0:
            self.usage = line
            if self.want_first:
                self.first, self.want_first = line, False
        if self.watch:
            self._watch(line, 0, len(line))

    def _watch(self, buf: bytes, start: int, end: int) -> None:
        if buf.find(b'data: {"error"', start, end) >= 0:
            self.error = True  # lmdeploy reports an engine error in the stream, then [DONE]
        elif not self.error and buf.find(b"data: [DONE]", start, end) >= 0:
            self.done = True

    def finish(self, outcome: Outcome, backend: str) -> None:
        """At the end of the stream: a last line without a newline counts too (as it always has);
        then the usage, if any, goes to ``outcome``: the first usage's, then the last's over it
        (Anthropic: the input tokens from the first, the output tokens from the last)."""
        if self.carry:
            self._line(b"".join(self.carry))
            self.carry.clear()
        if self.first:
            _read_sse_usage(self.first, outcome, backend, first=True)
        if self.usage:
            _read_sse_usage(self.usage, outcome, backend)


# A backend's usage is untrusted: a count is an int (not a bool) from 0 to this, else it is ignored
# as if absent (the gateway's estimate applies, flagged as one). 2**31 - 1: far past any model's
# context, and a request's prompt + completion (under 2**32) stays exact in the Lua doubles (2**53)
# and int64 INCRBYs that settle it in Redis, summed over a million requests. It does not stop a
# lying backend from charging a key up to that: the tpm bucket and budget take what is reported.
MAX_USAGE_TOKENS = 2**31 - 1
_BAD_USAGE_LOGGED: set[str] = set()  # backends whose invalid usage was logged: once each, not per request


def _tokens(value: Any, backend: str) -> int | None:
    if value is None:
        return None
    if type(value) is int and 0 <= value <= MAX_USAGE_TOKENS:
        return value
    if backend not in _BAD_USAGE_LOGGED:
        if len(_BAD_USAGE_LOGGED) >= 4096:  # bounded, whatever discovery adds
            _BAD_USAGE_LOGGED.clear()
        _BAD_USAGE_LOGGED.add(backend)
        log.warning("backend %s reported an invalid usage count %s: ignored (an estimate is used); not logged again for it",
                    backend, repr(value)[:64])
    return None


def _apply_usage(usage: Any, outcome: Outcome, backend: str) -> None:
    if not isinstance(usage, dict):
        return
    if "prompt_tokens" in usage:
        p = _tokens(usage["prompt_tokens"], backend)
    else:
        p = _tokens(usage.get("input_tokens"), backend)
        cache = (usage.get("cache_read_input_tokens"), usage.get("cache_creation_input_tokens"))
        if p is not None and cache != (None, None):
            # Anthropic's input_tokens leave out the prompt's cached part: the prompt is the sum.
            parts = [_tokens(v, backend) for v in cache]
            bad = any(n is None and v is not None for n, v in zip(parts, cache))
            p = None if bad else _tokens(p + (parts[0] or 0) + (parts[1] or 0), backend)
    c = _tokens(usage.get("completion_tokens", usage.get("output_tokens")), backend)
    if p is not None:
        outcome.prompt_tokens = p
    if c is not None:
        outcome.completion_tokens = c
    details = usage.get("prompt_tokens_details")
    cached = _tokens(details.get("cached_tokens") if isinstance(details, dict) else usage.get("cache_read_input_tokens"), backend)
    if cached is not None:
        outcome.cached_tokens = cached


def _read_usage(body: bytes, outcome: Outcome, backend: str) -> None:
    if len(body) > 1 << 20 or b'"usage"' not in body:
        return
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return
    if isinstance(data, dict):
        _apply_usage(data.get("usage") or (data.get("response") or {}).get("usage"), outcome, backend)


def _read_sse_usage(chunk: bytes, outcome: Outcome, backend: str, first: bool = False) -> None:
    """The usage object from the last SSE event that carries one (OpenAI, Responses or Anthropic),
    or with ``first`` the first one."""
    lines = chunk.split(b"\n")
    for line in lines if first else reversed(lines):
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                data = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            if isinstance(data, dict):
                usage = data.get("usage") or (data.get("response") or {}).get("usage") or (data.get("message") or {}).get("usage")
                _apply_usage(usage, outcome, backend)
            return
