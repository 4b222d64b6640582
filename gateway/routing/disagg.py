"""Two-phase dispatch for models served with prefill/decode disaggregation (lmdeploy's DistServe).

As lmdeploy's proxy does it (``serve/proxy/proxy.py``, ``pytorch/disagg/conn/proxy_conn.py``):

1. **Prefill**: the request goes to a prefill instance with ``max_tokens: 1``, no stream,
   ``with_cache`` and ``preserve_cache``; its answer carries the session ``id``,
   ``cache_block_ids`` and ``remote_token_ids``.
2. **Connect**, once per (prefill, decode) pair and cached: ``GET /distserve/engine_info`` on both,
   ``POST /distserve/p2p_initialize`` on both, then ``POST /distserve/p2p_connect`` on both with the
   other side's endpoint info. Concurrent requests for one pair share one attempt.
3. **Decode**: the client's request plus a ``migration_request`` goes to a decode instance, and
   its answer (a stream or not) is relayed to the client.
4. **Free**: if the decode fails, never starts, or the client leaves, the prefill instance's
   blocks are freed (``POST /distserve/free_cache``). On success the decode engine frees them itself.
5. **Drop**: when an instance leaves or dies, its connections are dropped
   (``/distserve/p2p_drop_connect`` on both ends) and sessions still migrating from it are freed.

Admission goes through the gateway queue (``queue.Admission``, as for hybrid models: priority
classes, fair shares among keys, max wait and shedding): the queue binds a request to a prefill
instance once one has room (``PDPicker.room``), and the decode instance is picked when the prefill
is done. Retries are picked at once, as the router's are. Classes below interactive, while
interactive requests come, leave ``queue.RESERVE`` of the prefill slots free and are kept off the prefill
and the decode instances that took more than ``PD_KEEP_SHARE`` times an even share of the recent
interactive requests (``Admission.kept``: the queue leaves out such prefill instances, this module
such decode instances, in ``room`` and when it picks the decode).

Only the gateway ever sets ``migration_request``, ``with_cache`` or ``preserve_cache``: the body
filter removes them from every client body before this module sees it. Retries follow the
router's rule: only before the client saw a byte, and a failed attempt's prefill blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import orjson
from prometheus_client import Counter

from .. import metrics
from ..config.balancer import DEFAULT_PRIORITY, QueueConfig
from ..config.disagg import MIGRATION_PROTOCOL_VALUE, ModelServing
from ..errors import Refusal, model_not_found, sse_error_event
from ..filters import RequestContext
from ..upstream import UpstreamFailure, UpstreamInvalid, UpstreamResponse, UpstreamTimeout, control_call
from .pd_policy import DecodeRun, PDPicker, PDRequest
from .pool import Backend, BackendPool
from .policies import Outcome
from .queue import LOW_PREFILL_AHEAD, Admission, GatewayQueue
from .router import TIMEOUTS, UPSTREAM_FAILED, SseScan, _read_usage, backend_error, open_upstream, queued_pick, refuse_invalid

log = logging.getLogger("gateway.disagg")

Send = Callable[[dict[str, Any]], Awaitable[None]]
Reply = Callable[[Refusal], Awaitable[None]]

PD_FREES = Counter("gateway_pd_cache_frees_total", "Prefill caches freed by the gateway, by why and outcome", ["why", "outcome"], registry=metrics.REGISTRY)
PD_CONNECTS = Counter("gateway_pd_connects_total", "Prefill-decode connection set-ups, by outcome", ["outcome"], registry=metrics.REGISTRY)

RECHECK_MIN = 0.01  # seconds: the soonest a predicted decode slot is looked at again (no busy loop on a stale prediction)
MAX_CONTROL_BYTES = 64 * 1024  # a /distserve/* answer is a few hundred bytes
MAX_PREFILL_BYTES = 16 * 1024 * 1024  # the prefill answer: one token plus the block ids
MAX_BLOCK_IDS = 1 << 20
SUCCESS = 1  # DistServeConnectionStatus.SUCCESS as lmdeploy dumps it
SERVED_KINDS = ("chat", "completions")  # what lmdeploy's proxy serves in DistServe mode

# The disaggregated models' queue's keep_share (queue.KEEP_SHARE is the hybrid models'); was
# balancer.queue.pd_keep_share until issue 33. Lower than 1.5, as PD instances are alike and the prefill
# picker sends interactive requests to the one without batch work: bench/routing PD --mixed socket runs,
# 2026-12-03 (e6a4540), seed 7 ui 40 %: interactive TTFT p99 beside the flood +52 % off, +53 % at 1.5, +32 % at 1.1, +24 % at 1.0.
PD_KEEP_SHARE = 1.0

NO_INSTANCE = Refusal(503, "No healthy prefill or decode instance is available for this model; try again shortly.", "no_pd_instance", code="service_unavailable")
PREFILL_INVALID = Refusal(502, "The prefill instance sent an answer that could not be used.", "prefill_invalid", code="bad_gateway")
DECODE_FAILED = Refusal(502, "The decode instance could not take over the request.", "decode_failed", code="bad_gateway")
CONNECT_FAILED = Refusal(502, "The prefill and decode instances could not be connected.", "pd_connect_failed", code="bad_gateway")
N_REFUSED = Refusal(400, "n > 1 is not supported with the DistServe serving strategy.", "n_not_supported", param="n", code="invalid_request")
PROMPTS_REFUSED = Refusal(400, "Only one prompt per request is supported with the DistServe serving strategy.", "prompts_not_supported", param="prompt", code="invalid_request")


def route_refused(kind: str) -> Refusal:
    return Refusal(
        400,
        f"This model is served with prefill/decode disaggregation, which supports only /v1/chat/completions and /v1/completions (not {kind}).",
        "route_not_disaggregated",
        param="model",
        code="invalid_request",
    )


class PDError(Exception):
    """A control-plane step failed; the message is for logs only."""


@dataclass(frozen=True, slots=True)
class PrefillResult:
    session_id: int
    block_ids: list[int]
    token_id: int


def parse_prefill(body: bytes) -> PrefillResult | None:
    """The fields lmdeploy's proxy reads from a prefill answer (``id``, ``cache_block_ids``, ``remote_token_ids``), validated."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    try:
        session_id = int(data.get("id"))  # lmdeploy: int(prefill_info.get('id'))
    except (TypeError, ValueError):
        return None
    blocks = data.get("cache_block_ids") or []
    tokens = data.get("remote_token_ids") or []
    if not isinstance(blocks, list) or not isinstance(tokens, list) or len(blocks) > MAX_BLOCK_IDS or len(tokens) > MAX_BLOCK_IDS:
        return None
    if not all(type(x) is int and 0 <= x < 1 << 62 for x in blocks) or not all(type(x) is int and 0 <= x < 1 << 62 for x in tokens):
        return None
    if not -(1 << 62) < session_id < 1 << 62:
        return None
    return PrefillResult(session_id, blocks, tokens[-1] if tokens else 0)


def _engine_config(data: Any) -> dict[str, Any]:
    """lmdeploy's DistServeEngineConfig; /distserve/engine_info returns it as a JSON string inside JSON."""
    if isinstance(data, str):
        data = orjson.loads(data)
    if not isinstance(data, dict):
        raise PDError("engine_info is not an object")
    out: dict[str, Any] = {}
    for name in ("tp_size", "ep_size", "dp_size", "dp_rank", "block_size", "num_cpu_blocks", "num_gpu_blocks"):
        v = data.get(name)
        if type(v) is not int or not 0 <= v < 1 << 40:
            raise PDError(f"engine_info.{name} is missing or not an integer")
        out[name] = v
    pp = data.get("pp_size")
    if pp is not None and (type(pp) is not int or not 0 <= pp < 1 << 20):
        raise PDError("engine_info.pp_size is not an integer")
    out["pp_size"] = pp
    return out


def _init_response(data: Any) -> dict[str, Any]:
    """lmdeploy's DistServeInitResponse, reduced to what p2p_connect needs."""
    if not isinstance(data, dict) or data.get("status") != SUCCESS:
        raise PDError("p2p_initialize did not succeed")
    ep = data.get("engine_endpoint_info")
    kv = data.get("kvtransfer_endpoint_info")
    if not isinstance(ep, dict) or not isinstance(ep.get("zmq_address"), str) or not isinstance(kv, list) or len(kv) > 1024:
        raise PDError("p2p_initialize answer is malformed")
    for item in kv:
        if not isinstance(item, dict) or type(item.get("protocol")) is not int or not isinstance(item.get("endpoint_info"), str):
            raise PDError("p2p_initialize kvtransfer_endpoint_info is malformed")
    return {"engine_endpoint_info": {"zmq_address": ep["zmq_address"]}, "kvtransfer_endpoint_info": kv}


class PDConnections:
    """The P<->D links, set up once per pair and cached; dropped when either end leaves."""

    def __init__(self, client_of: Callable[[], Any], timeout: float, picker: PDPicker):
        self._client_of = client_of
        self.timeout = timeout
        self.picker = picker
        self._links: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._ends: dict[tuple[str, str], tuple[Backend, Backend]] = {}
        self.engine_info: dict[str, dict[str, Any]] = {}
        # Sessions migrating over a link: freed on the prefill end if the link is dropped mid-way.
        self.shelf: dict[tuple[str, str], set[int]] = {}
        self.setups = 0

    def connected(self, p: Backend, d: Backend) -> bool:
        f = self._links.get((p.id, d.id))
        return f is not None and f.done() and not f.cancelled() and f.exception() is None

    async def _call(self, b: Backend, method: str, path: str, body: Any = None) -> Any:
        client = self._client_of()
        headers = {"authorization": f"Bearer {b.api_key}"} if b.api_key else {}
        if body is not None:
            headers["content-type"] = "application/json"
        try:
            content = None if body is None else orjson.dumps(body)
            status, data = await control_call(client, method, b.url + path, headers=headers, content=content, limit=MAX_CONTROL_BYTES, timeout=self.timeout)
        except Exception as exc:  # any transport failure is a failed step
            raise PDError(f"{path} on {b.id}: {exc.__class__.__name__}") from None
        if status != 200:
            raise PDError(f"{path} on {b.id}: HTTP {status}")
        if data is None:
            raise PDError(f"{path} on {b.id}: answer too large")  # never read whole
        try:
            return orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            raise PDError(f"{path} on {b.id}: answer is not JSON") from None

    async def info(self, b: Backend) -> dict[str, Any]:
        cfg = self.engine_info.get(b.id)
        if cfg is None:
            cfg = _engine_config(await self._call(b, "GET", "/distserve/engine_info"))
            self.engine_info[b.id] = cfg
            if b.role == "decode":
                self.picker.set_capacity(b, cfg["num_gpu_blocks"] * cfg["block_size"])
        return cfg

    async def ensure(self, p: Backend, d: Backend, serving: ModelServing) -> None:
        """Connected once per pair. The set-up runs in its own task, so a client that leaves
        mid-way does not fail the other requests waiting on the same pair."""
        key = (p.id, d.id)
        task = self._links.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.get_running_loop().create_task(self._setup(key, p, d, serving))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure nobody awaits is not "unretrieved"
            self._links[key] = task
            self._ends[key] = (p, d)
        await asyncio.shield(task)

    async def _setup(self, key: tuple[str, str], p: Backend, d: Backend, serving: ModelServing) -> None:
        try:
            await self._connect(p, d, serving)
        except BaseException as exc:
            if self._links.get(key) is asyncio.current_task():
                self._links.pop(key, None)
                self._ends.pop(key, None)
            PD_CONNECTS.labels(outcome="failed").inc()
            if isinstance(exc, PDError):
                raise
            raise PDError(f"{exc.__class__.__name__}: {exc}") from None
        self.setups += 1
        PD_CONNECTS.labels(outcome="ok").inc()

    async def _connect(self, p: Backend, d: Backend, serving: ModelServing) -> None:
        pcfg, dcfg = await asyncio.gather(self.info(p), self.info(d))
        if pcfg["tp_size"] != dcfg["tp_size"]:  # lmdeploy: only the same parallel configuration connects
            raise PDError(f"tp_size differs: {p.id} has {pcfg['tp_size']}, {d.id} has {dcfg['tp_size']}")
        protocol = MIGRATION_PROTOCOL_VALUE[serving.migration_protocol]
        rdma = serving.rdma.wire() if serving.migration_protocol == "RDMA" else None
        nvlink: dict[str, Any] | None = {} if serving.migration_protocol == "NVLINK" else None

        def init(local: Backend, lcfg: dict[str, Any], remote: Backend, rcfg: dict[str, Any]) -> dict[str, Any]:
            return {
                "local_engine_id": local.url,
                "local_engine_config": lcfg,
                "remote_engine_id": remote.url,
                "remote_engine_config": rcfg,
                "protocol": protocol,
                "rank": None,
                "tcp_config": None,
                "rdma_config": rdma,
                "nvlink_config": nvlink,
            }

        p_init = _init_response(await self._call(p, "POST", "/distserve/p2p_initialize", init(p, pcfg, d, dcfg)))
        d_init = _init_response(await self._call(d, "POST", "/distserve/p2p_initialize", init(d, dcfg, p, pcfg)))

        def conn(remote: Backend, remote_init: dict[str, Any]) -> dict[str, Any]:
            return {
                "protocol": protocol,
                "remote_engine_id": remote.url,
                "remote_engine_endpoint_info": remote_init["engine_endpoint_info"],
                "remote_kvtransfer_endpoint_info": remote_init["kvtransfer_endpoint_info"],
            }

        for b, body in ((p, conn(d, d_init)), (d, conn(p, p_init))):
            r = await self._call(b, "POST", "/distserve/p2p_connect", body)
            if not isinstance(r, dict) or r.get("status") != SUCCESS:
                raise PDError(f"p2p_connect on {b.id} did not succeed")

    async def free(self, p: Backend, session_id: int, why: str) -> bool:
        try:
            await self._call(p, "POST", "/distserve/free_cache", {"remote_engine_id": p.url, "remote_session_id": session_id})
        except PDError as exc:
            log.warning("freeing prefill cache failed (%s): %s", why, exc)
            PD_FREES.labels(why=why, outcome="failed").inc()
            return False
        PD_FREES.labels(why=why, outcome="ok").inc()
        return True

    async def drop_backend(self, backend_id: str) -> None:
        """An instance left or died: drop every link it is part of, on both ends; free shelved sessions."""
        self.engine_info.pop(backend_id, None)
        for key in [k for k in self._links if backend_id in k]:
            task = self._links.pop(key, None)
            if task is not None and not task.done():
                task.cancel()
            ends = self._ends.pop(key, None)
            if ends is None:
                continue
            p, d = ends
            for sid in self.shelf.pop(key, set()):
                await self.free(p, sid, "instance_left")
            for left, right in ((p, d), (d, p)):
                if left.id == backend_id and not left.healthy:
                    continue  # it is gone: nobody to tell
                try:
                    await self._call(left, "POST", "/distserve/p2p_drop_connect", {"engine_id": left.url, "remote_engine_id": right.url})
                except PDError as exc:
                    log.info("p2p_drop_connect on %s: %s", left.id, exc)


class PDDispatcher:
    def __init__(self, pool: BackendPool, models: dict[str, ModelServing], retries: int = 1, control_timeout: float = 10.0, slots: int | None = None):
        """slots: every instance's batch slots when configured (``balancer.slots``)."""
        self.pool = pool
        self.models = {n: m for n, m in models.items() if m.distserve}
        self.retries = retries
        self.upstream: Any = None  # set at start-up, like the router's
        self.client: Any = None  # the control-plane httpx client, set at start-up
        self.picker = PDPicker(slots=slots)
        self.conns = PDConnections(lambda: self.client, control_timeout, self.picker)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closing = False
        self.queue: GatewayQueue | None = None  # set by enable_queue
        self._rechecks: dict[str, asyncio.TimerHandle] = {}  # by model: when a decode slot is predicted in time
        pool.on_change(self._backend_changed)

    def enable_queue(self, config: QueueConfig, clock: Callable[[], float]) -> GatewayQueue:
        """Admission through the gateway queue: it binds the prefill phase (the picker is its binder)."""
        def prefills(model: str) -> list[Backend]:
            return [b for b in self.pool.eligible(model) if b.role == "prefill"]

        # Its own Admission (the hybrid models' is the router's): the PD share of interactive binds keeps instances.
        self.queue = GatewayQueue(Admission(config, self.picker, prefills, clock, room=self._room, keep_share=PD_KEEP_SHARE))
        return self.queue

    def _room(self, prefills: Any, req: PDRequest, priority: int) -> list[Backend]:
        """The queue's ``room``: it has left out the prefill instances kept for interactive requests
        (``Admission.fit``); the decode instances kept for them are left out here."""
        adm = self.queue.admission  # type: ignore[union-attr]
        decodes = self._decodes(req, [b for b in self.pool.eligible(req.model) if b.role == "decode"], priority)
        if adm.reserving(req.model, priority):  # leave slots and an empty prefill queue to interactive requests
            fit, wait = self.picker.room_or_wait(prefills, decodes, req, min(adm.hold_wait, LOW_PREFILL_AHEAD), adm.reserve)
        else:
            fit, wait = self.picker.room_or_wait(prefills, decodes, req, adm.hold_wait)
        if not fit and wait < math.inf:
            self._recheck(req.model, wait)
        return fit

    def _decodes(self, req: PDRequest, decodes: list[Backend], priority: int | None) -> list[Backend]:
        """The decode instances req's class may take: below interactive, while interactive requests
        come, not those kept for them (``Admission.kept``: they took most of the interactive
        decodes; a batch sequence there slows the steps of most interactive requests)."""
        if self.queue is None or priority is None or not self.queue.admission.reserving(req.model, priority):
            return decodes
        return list(self.queue.admission.unkept(req.model, decodes))

    def pick_decode(self, req: PDRequest, decodes: list[Backend]) -> Backend:
        """req's decode instance (its prefill is done), among those its class may take; an
        interactive request's counts for the decode instances kept for them."""
        d = self.picker.pick_decode(self._decodes(req, decodes, req.priority), req.decode_tokens)
        if self.queue is not None and req.priority is not None and req.priority >= DEFAULT_PRIORITY:
            self.queue.admission.top_bound(req.model, d)
        return d

    def _recheck(self, model: str, wait: float) -> None:
        """Wake the queue when a decode slot is predicted in time: no response ends then, yet the
        prefill must start then to overlap the decode it waits for. One timer per model, the earliest."""
        loop = asyncio.get_running_loop()
        at = loop.time() + max(wait, RECHECK_MIN)
        timer = self._rechecks.get(model)
        if timer is not None and not timer.cancelled() and timer.when() <= at:
            return
        if timer is not None:
            timer.cancel()
        self._rechecks[model] = loop.call_at(at, self._recheck_due, model)

    def close(self) -> None:
        """Shutting down: instances stopping now are not "lost" (no drops, no frees), no more rechecks."""
        self.closing = True
        for timer in self._rechecks.values():
            timer.cancel()
        self._rechecks.clear()

    def _recheck_due(self, model: str) -> None:
        self._rechecks.pop(model, None)
        if self.queue is not None and not self.closing:
            self.queue.wake(model)

    def serves(self, model: str) -> bool:
        return model in self.models

    # -- membership ----------------------------------------------------------------------------
    def _backend_changed(self, b: Backend) -> None:
        if self.closing or b.role == "hybrid" or (b.healthy and self.pool.get(b.id) is b):
            return
        if self.conns.engine_info.get(b.id) is None and not any(b.id in k for k in self.conns._links):
            return
        self._background(self.conns.drop_backend(b.id))
        self.picker.forget(b.id)

    def _background(self, coro: Awaitable[Any]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        except RuntimeError:  # no loop (a config-time change): nothing is connected yet
            coro.close()  # type: ignore[union-attr]
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_idle(self) -> None:
        """Let background frees and drops finish (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- one request ---------------------------------------------------------------------------
    async def forward(self, ctx: RequestContext, headers: list[tuple[bytes, bytes]], send: Send, reply: Reply) -> int:
        model = ctx.model or ""
        serving = self.models[model]
        kind = ctx.route.kind
        body = ctx.body or {}
        refusal = None
        if kind not in SERVED_KINDS:
            refusal = route_refused(ctx.route.path)
        elif body.get("n") not in (None, 1):
            refusal = N_REFUSED
        elif kind == "completions" and isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
            if len(body["prompt"]) > 1:
                refusal = PROMPTS_REFUSED
        if refusal is not None:
            await reply(refusal)
            return refusal.status
        path = ctx.route.upstream_path
        prefill_body = dict(body)
        prefill_body["max_tokens"] = 1
        if kind == "chat":
            prefill_body["max_completion_tokens"] = 1
        prefill_body["stream"] = False
        prefill_body.pop("stream_options", None)
        prefill_body["with_cache"] = True
        prefill_body["preserve_cache"] = True
        prefill_payload = orjson.dumps(prefill_body)
        prompt = orjson.dumps(body.get("messages") if kind == "chat" else body.get("prompt"))
        tokens = max(1, len(prompt) // 4)  # a rough count: enough to compare instances
        out = body.get("max_completion_tokens") or body.get("max_tokens")
        out = out if type(out) is int and out > 0 else None
        req = PDRequest(model=model, stream=body.get("stream") is True, prompt_tokens=tokens, max_tokens=out,
                        prompt=prompt, decode_tokens=tokens + (out or 512), out_tokens=out or 512)
        tried_p: set[str] = set()
        tried_d: set[str] = set()
        queued = False
        try:
            for attempt in range(1 + self.retries):
                last = attempt == self.retries
                eligible = self.pool.eligible(model)
                ps = [b for b in eligible if b.role == "prefill"]
                ds = [b for b in eligible if b.role == "decode"]
                ps = [b for b in ps if b.id not in tried_p] or ps
                ds = [b for b in ds if b.id not in tried_d] or ds
                if not ps or not ds:
                    refusal = NO_INSTANCE if self.pool.knows_model(model) else model_not_found(model)
                    await reply(refusal)
                    return refusal.status
                if attempt == 0 and self.queue is not None:
                    # The queue binds the prefill phase (picked and dispatched) when an instance has room.
                    admitted = await queued_pick(self.queue, ctx, req, len(ps), reply)
                    if isinstance(admitted, int):
                        return admitted
                    p, queued = admitted, True
                else:
                    p = self.picker.pick(ps, req)
                    self.picker.dispatched(p, req)
                result = await self._prefill(p, req, path, prefill_payload, headers, send, reply, last)
                if result is None:
                    tried_p.add(p.id)
                    metrics.RETRIES.labels(reason="prefill_failed").inc()
                    continue
                if isinstance(result, int):
                    return result  # the prefill instance's own answer (an error) went to the client
                # Decode instances as they are now: the request may have waited in the queue meanwhile.
                ds = [b for b in self.pool.eligible(model) if b.role == "decode" and b.id not in tried_d] or ds
                d = self.pick_decode(req, ds)
                status = await self._decode_phase(p, d, result, serving, ctx, body, path, headers, send, reply, last, req)
                if status is not None:
                    return status
                tried_d.add(d.id)
                metrics.RETRIES.labels(reason="decode_failed").inc()
            raise AssertionError("unreachable: the last attempt always answers")
        finally:
            if queued:  # a decode's KV is freed (or the request failed): a waiter may start now
                self.queue.completed(model)  # type: ignore[union-attr]

    async def _prefill(
        self, p: Backend, req: PDRequest, path: str, payload: bytes, headers: list[tuple[bytes, bytes]], send: Send, reply: Reply, last: bool
    ) -> PrefillResult | int | None:
        """The prefill phase on p (already ``dispatched``): its result, the status already sent to
        the client, or None to retry."""
        start = time.monotonic()
        outcome = Outcome(status=0, ok=False)
        try:
            response = await open_upstream(self.upstream, self.pool, p, path, payload, headers, reply, last)
            if not isinstance(response, UpstreamResponse):
                return response
            try:
                try:
                    data = await self.upstream.read_all(response)
                finally:
                    await response.aclose()
            except UpstreamTimeout as exc:
                self.pool.report_failure(p)
                await reply(TIMEOUTS[exc.phase])
                return TIMEOUTS[exc.phase].status
            except UpstreamInvalid as exc:
                return await refuse_invalid(self.pool, p, exc, reply)
            except UpstreamFailure as exc:
                metrics.UPSTREAM_ERRORS.labels(backend=p.id, kind=exc.kind).inc()
                self.pool.report_failure(p)
                if last:
                    await reply(UPSTREAM_FAILED)
                    return UPSTREAM_FAILED.status
                return None
            if response.status >= 500:
                self.pool.report_failure(p)
                if response.status in (502, 503) and not last:
                    return None
                # As the router does: a backend's 5xx body may hold a traceback; our own error, same status.
                log.warning("prefill instance %s answered %d: %r", p.id, response.status, data[:2048])
                await reply(backend_error(response.status, None))
                return response.status
            if response.status != 200:
                await _send_whole(send, response, data)  # the backend's own refusal (a too-long prompt, ...)
                return response.status
            self.pool.report_success(p)
            outcome.ok, outcome.ttft = True, time.monotonic() - start
            result = parse_prefill(data) if len(data) <= MAX_PREFILL_BYTES else None
            if result is None:
                log.warning("prefill answer from %s is not usable", p.id)
                await reply(PREFILL_INVALID)
                return PREFILL_INVALID.status
            return result
        finally:
            self.picker.completed(p, req, outcome)
            # Its slot is free: the next waiter's prefill may start. After a prefill that succeeded,
            # only once the request holds its decode slot (``_decode_phase``): woken before, a
            # waiter would count neither this prefill nor this decode and take the decode slot too.
            if self.queue is not None and not outcome.ok:
                self.queue.wake(req.model)

    async def _decode_phase(
        self,
        p: Backend,
        d: Backend,
        pre: PrefillResult,
        serving: ModelServing,
        ctx: RequestContext,
        body: dict[str, Any],
        path: str,
        headers: list[tuple[bytes, bytes]],
        send: Send,
        reply: Reply,
        last: bool,
        req: PDRequest,
    ) -> int | None:
        """Connect, decode, relay. Frees the prefill blocks unless the decode finished. None: retry.
        d's slot and KV are the request's from the first line (no await before it since the prefill ended)."""
        progress = {"done": False}  # set once the client has the whole answer, even if it leaves right after
        key = (p.id, d.id)
        shelved = False
        run = self.picker.decode_started(d, req.decode_tokens, req.out_tokens)
        d.in_flight += 1
        if self.queue is not None:  # the prefill slot it left is free, its decode slot counted
            self.queue.wake(req.model)
        try:
            try:
                await self.conns.ensure(p, d, serving)
            except PDError as exc:
                log.warning("P-D connection %s -> %s failed: %s", p.id, d.id, exc)
                if last:
                    await reply(CONNECT_FAILED)
                    return CONNECT_FAILED.status
                return None
            decode_body = dict(body)
            decode_body["migration_request"] = {
                "protocol": MIGRATION_PROTOCOL_VALUE[serving.migration_protocol],
                "remote_engine_id": p.url,
                "remote_session_id": pre.session_id,
                "remote_token_id": pre.token_id,
                "remote_block_ids": pre.block_ids,
                "is_dummy_prefill": False,
            }
            self.conns.shelf.setdefault(key, set()).add(pre.session_id)
            shelved = True
            return await self._decode(d, ctx, orjson.dumps(decode_body), path, headers, send, reply, last, progress, run)
        finally:
            d.in_flight -= 1
            self.picker.decode_done(d, req.decode_tokens, run, ok=progress["done"])
            if shelved:
                self.conns.shelf.get(key, set()).discard(pre.session_id)
            if not progress["done"]:
                # Decode failed, never started, or the client left (this also runs on cancellation).
                self._background(self.conns.free(p, pre.session_id, "decode_not_done"))

    async def _decode(
        self, d: Backend, ctx: RequestContext, payload: bytes, path: str, headers: list[tuple[bytes, bytes]],
        send: Send, reply: Reply, last: bool, progress: dict[str, bool], run: DecodeRun,
    ) -> int | None:
        outcome = Outcome(status=0, ok=False)
        try:
            response = await open_upstream(self.upstream, self.pool, d, path, payload, headers, reply, last)
            if not isinstance(response, UpstreamResponse):
                return response
            outcome.status = response.status
            try:
                if response.status >= 500:
                    # lmdeploy fails a migration (an unreachable prefill engine, a dropped link) with a 5xx:
                    # before any byte the whole request is retried, else answered with our own error.
                    self.pool.report_failure(d)
                    if not last:
                        return None
                    await reply(DECODE_FAILED)
                    return DECODE_FAILED.status
                else:
                    self.pool.report_success(d)
                if response.status == 200 and response.is_event_stream:
                    await self._relay_stream(d, ctx, response, send, progress, outcome, run)
                    return 200
                try:
                    data = await self.upstream.read_all(response)
                except UpstreamTimeout as exc:
                    self.pool.report_failure(d)
                    await reply(TIMEOUTS[exc.phase])
                    return TIMEOUTS[exc.phase].status
                except UpstreamFailure:
                    self.pool.report_failure(d)
                    if last:
                        await reply(UPSTREAM_FAILED)
                        return UPSTREAM_FAILED.status
                    return None
                progress["done"] = response.status == 200
                if response.status == 200:
                    _read_usage(data, outcome, d.id)
                await _send_whole(send, response, data)
                return response.status
            finally:
                await response.aclose()
        finally:
            outcome.ok = progress["done"]
            ctx.backend, ctx.outcome = d.id, outcome  # usage for the limits' settling, the access log and the trace

    async def _relay_stream(
        self, d: Backend, ctx: RequestContext, response: UpstreamResponse, send: Send, progress: dict[str, bool], outcome: Outcome, run: DecodeRun
    ) -> None:
        hdrs = list(response.headers) + [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        await send({"type": "http.response.start", "status": 200, "headers": hdrs})
        # Lines are scanned whole however the reads cut them (SseScan): the usage, lmdeploy's
        # in-stream error event and [DONE] are each seen once.
        scan = SseScan(watch=True)
        started = time.monotonic()
        try:
            async for chunk in response.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if outcome.ttft is None:
                    outcome.ttft = time.monotonic() - started
                    run.first_at = self.picker.clock()  # decoding from now: when its slot frees is predicted from here
                scan.read(chunk)
                if scan.done:
                    progress["done"] = True  # the client has it all: the decode engine frees the prefill blocks
        except (UpstreamTimeout, UpstreamFailure) as exc:
            kind = f"{exc.phase}_timeout" if isinstance(exc, UpstreamTimeout) else "stream_broken"
            metrics.UPSTREAM_ERRORS.labels(backend=d.id, kind=kind).inc()
            self.pool.report_failure(d)
            log.warning("decode stream from %s broke mid-way (%s)", d.id, kind)
            event = sse_error_event("The backend stopped answering before the response was complete.", ctx.style)
            await send({"type": "http.response.body", "body": event, "more_body": False})
            return
        scan.finish(outcome, d.id)
        progress["done"] = not scan.error
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_whole(send: Send, response: UpstreamResponse, data: bytes) -> None:
    hdrs = [h for h in response.headers if h[0] != b"content-length"]
    hdrs.append((b"content-length", str(len(data)).encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data, "more_body": False})
