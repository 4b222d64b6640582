"""Prefill/decode disaggregation in the simulator: lmdeploy's ``/distserve/*`` routes and KV migration.

Shapes are lmdeploy's (``serve/openai/endpoints/distserve.py``, ``pytorch/disagg/conn/protocol.py``):

- ``GET /distserve/engine_info``: ``DistServeEngineConfig.model_dump_json()`` returned from a
  FastAPI route, so the body is that JSON *as a JSON string*;
- ``POST /distserve/p2p_initialize``: ``DistServeInitRequest`` in, ``DistServeInitResponse`` out
  (``status`` 1 = SUCCESS, enums dumped by value);
- ``POST /distserve/p2p_connect``: needs a prior p2p_initialize for that remote (lmdeploy raises
  ``KeyError``: a 500), answers ``{"status": 1}``;
- ``POST /distserve/p2p_drop_connect``: ``{"success": true}``;
- ``POST /distserve/free_cache``: ``{"status": "SUCCESS"}``, whether or not the session was held.

A **prefill** instance answers a ``with_cache`` request with ``cache_block_ids``, ``remote_token_ids``
(one token) and the session id as ``id``, and holds the blocks (they count against its KV) until
they are migrated, freed, or expire. A **decode** instance takes a ``migration_request``: it refuses
one from a prefill instance it is not connected to, else pulls the blocks (the simulator's stand-in
for lmdeploy's RDMA read plus its ZMQ free message: ``POST {remote}/_sim/migrate``) and skips prefill.
Every free is recorded (``GET /_sim/distserve``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from .errors import ApiError, json_response
from .requests import read_json, sim_of
from .state import SimState

SUCCESS = 1  # DistServeConnectionStatus.SUCCESS
RDMA = 2  # MigrationProtocol.RDMA
_FREE_LOG_LIMIT = 10_000


@dataclass
class Held:
    session_id: int
    block_ids: list[int]
    tokens: int
    timer: asyncio.TimerHandle | None = None


@dataclass
class DistServeState:
    role: str
    local_ids: dict[str, str] = field(default_factory=dict)  # remote engine id -> our id as it named us
    initialized: set[str] = field(default_factory=set)
    connected: set[str] = field(default_factory=set)
    held: dict[int, Held] = field(default_factory=dict)
    frees: list[dict[str, Any]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=lambda: {"engine_info": 0, "p2p_initialize": 0, "p2p_connect": 0, "p2p_drop_connect": 0, "free_cache": 0})
    migrations: int = 0
    refused_migrations: int = 0
    fail_next: dict[str, int] = field(default_factory=dict)  # route name -> count of 500s to inject
    exit_after_prefill: bool = False  # die (os._exit) when a decode instance comes for the blocks: after the prefill answer, before migration
    _sessions: Any = field(default_factory=lambda: itertools.count(1))
    _blocks: Any = field(default_factory=lambda: itertools.count(0))
    _client: httpx.AsyncClient | None = None

    def snapshot(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "initialized": sorted(self.initialized),
            "connected": sorted(self.connected),
            "held": sorted(self.held),
            "frees": list(self.frees),
            "calls": dict(self.calls),
            "migrations": self.migrations,
            "refused_migrations": self.refused_migrations,
        }

    def record_free(self, session_id: int, why: str, held: bool) -> None:
        if len(self.frees) >= _FREE_LOG_LIMIT:
            del self.frees[0]
        self.frees.append({"time": time.time(), "session_id": session_id, "why": why, "held": held})

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=10.0)
        return self._client


def ds_of(sim: SimState) -> DistServeState:
    ds = getattr(sim, "distserve", None)
    if ds is None:
        ds = DistServeState(role=sim.config.role)
        sim.distserve = ds  # type: ignore[attr-defined]
    return ds


def _maybe_fail(ds: DistServeState, name: str) -> None:
    n = ds.fail_next.get(name, 0)
    if n > 0:
        ds.fail_next[name] = n - 1
        raise ApiError(500, f"Simulated {name} failure.")


def _require(body: dict[str, Any], *names: str) -> None:
    missing = [n for n in names if n not in body]
    if missing:
        # FastAPI's request validation error (422), as lmdeploy's pydantic models produce it.
        raise _Unprocessable(missing)


class _Unprocessable(ApiError):
    def __init__(self, missing: list[str]) -> None:
        super().__init__(422, "Field required")
        self.missing = missing


def _unprocessable(exc: _Unprocessable) -> Response:
    return json_response({"detail": [{"type": "missing", "loc": ["body", n], "msg": "Field required", "input": None} for n in exc.missing]}, 422)


# -- /distserve/* ---------------------------------------------------------------------------------


async def engine_info(request: Request) -> Response:
    sim = sim_of(request)
    ds = ds_of(sim)
    ds.calls["engine_info"] += 1
    _maybe_fail(ds, "engine_info")
    cfg = sim.config
    info = {
        "tp_size": 1,
        "ep_size": 1,
        "dp_size": 1,
        "pp_size": None,
        "dp_rank": 0,
        "block_size": cfg.block_tokens,
        "num_cpu_blocks": 0,
        "num_gpu_blocks": cfg.kv_capacity_tokens // cfg.block_tokens,
    }
    return json_response(orjson.dumps(info).decode())  # a JSON string holding the JSON, as lmdeploy sends it


async def p2p_initialize(request: Request) -> Response:
    sim = sim_of(request)
    ds = ds_of(sim)
    body = await read_json(request)
    ds.calls["p2p_initialize"] += 1
    try:
        _require(body, "local_engine_id", "local_engine_config", "remote_engine_id", "remote_engine_config", "protocol")
    except _Unprocessable as exc:
        return _unprocessable(exc)
    _maybe_fail(ds, "p2p_initialize")
    remote = str(body["remote_engine_id"])
    ds.initialized.add(remote)
    ds.local_ids[remote] = str(body["local_engine_id"])
    port = request.url.port or 0
    return json_response(
        {
            "status": SUCCESS,
            "engine_endpoint_info": {"zmq_address": f"tcp://127.0.0.1:{port + 10000 if port < 55535 else port}"},
            "kvtransfer_endpoint_info": [{"protocol": body.get("protocol", RDMA), "endpoint_info": f'{{"sim": {os.getpid()}}}'}],
        }
    )


async def p2p_connect(request: Request) -> Response:
    sim = sim_of(request)
    ds = ds_of(sim)
    body = await read_json(request)
    ds.calls["p2p_connect"] += 1
    try:
        _require(body, "protocol", "remote_engine_id", "remote_engine_endpoint_info", "remote_kvtransfer_endpoint_info")
    except _Unprocessable as exc:
        return _unprocessable(exc)
    _maybe_fail(ds, "p2p_connect")
    remote = str(body["remote_engine_id"])
    if remote not in ds.initialized:
        return Response("Internal Server Error", status_code=500, media_type="text/plain")  # lmdeploy: KeyError
    ds.connected.add(remote)
    return json_response({"status": SUCCESS})


async def p2p_drop_connect(request: Request) -> Response:
    sim = sim_of(request)
    ds = ds_of(sim)
    body = await read_json(request)
    ds.calls["p2p_drop_connect"] += 1
    try:
        _require(body, "engine_id", "remote_engine_id")
    except _Unprocessable as exc:
        return _unprocessable(exc)
    remote = str(body["remote_engine_id"])
    ds.connected.discard(remote)
    ds.initialized.discard(remote)
    return json_response({"success": True})


async def free_cache(request: Request) -> Response:
    sim = sim_of(request)
    ds = ds_of(sim)
    body = await read_json(request)
    ds.calls["free_cache"] += 1
    try:
        _require(body, "remote_engine_id", "remote_session_id")
    except _Unprocessable as exc:
        return _unprocessable(exc)
    sid = body["remote_session_id"]
    held = release(sim, sid) if isinstance(sid, int) else False
    ds.record_free(sid if isinstance(sid, int) else -1, "free_cache", held)
    return json_response({"status": "SUCCESS"})


# -- prefill side ------------------------------------------------------------------------------------


def hold(sim: SimState, prompt_tokens: int) -> Held:
    """Keep a finished prefill's blocks for migration; returns what the answer reports."""
    ds = ds_of(sim)
    blocks = max(1, math.ceil(prompt_tokens / sim.config.block_tokens))
    h = Held(next(ds._sessions), [next(ds._blocks) for _ in range(blocks)], blocks * sim.config.block_tokens)
    sim.engine.hold(h.tokens)
    ds.held[h.session_id] = h

    def expire() -> None:
        if release(sim, h.session_id):
            ds.record_free(h.session_id, "expired", True)

    h.timer = asyncio.get_running_loop().call_later(sim.config.cache_hold_seconds, expire)
    return h


def release(sim: SimState, session_id: int) -> bool:
    ds = ds_of(sim)
    h = ds.held.pop(session_id, None)
    if h is None:
        return False
    if h.timer is not None:
        h.timer.cancel()
    sim.engine.release(h.tokens)
    return True


def with_cache_fields(h: Held, token_id: int) -> dict[str, Any]:
    return {"id": str(h.session_id), "cache_block_ids": h.block_ids, "remote_token_ids": [token_id]}


async def migrate_out(request: Request) -> Response:
    """``POST /_sim/migrate`` from a decode instance: hand over (and free) a held session."""
    sim = sim_of(request)
    ds = ds_of(sim)
    body = await read_json(request)
    if ds.exit_after_prefill:
        os._exit(1)  # a crash between prefill and migration: no answer, no graceful shutdown
    engine_id, sid, blocks = body.get("engine_id"), body.get("session_id"), body.get("block_ids")
    if engine_id not in ds.connected:
        return json_response({"error": f"not connected to {engine_id!r}"}, 409)
    h = ds.held.get(sid) if isinstance(sid, int) else None
    if h is None or blocks != h.block_ids:
        return json_response({"error": f"session {sid!r} holds no such blocks"}, 404)
    release(sim, sid)
    ds.record_free(sid, "migrated", True)
    return json_response({"ok": True})


# -- decode side -------------------------------------------------------------------------------------


def parse_migration(body: dict[str, Any]) -> dict[str, Any] | None:
    m = body.pop("migration_request", None)
    if m is None:
        return None
    ok = (
        isinstance(m, dict)
        and type(m.get("protocol")) is int
        and isinstance(m.get("remote_engine_id"), str)
        and type(m.get("remote_session_id")) is int
        and type(m.get("remote_token_id")) is int
        and isinstance(m.get("remote_block_ids"), list)
        and all(type(b) is int for b in m["remote_block_ids"])
    )
    if not ok:
        raise ApiError(400, "Invalid migration_request.", param="migration_request")
    return m


async def migrate_in(sim: SimState, m: dict[str, Any]) -> None:
    """Pull the blocks from the prefill instance named in the migration request, or refuse."""
    ds = ds_of(sim)
    remote = m["remote_engine_id"]
    if m.get("is_dummy_prefill"):
        return
    if remote not in ds.connected:
        ds.refused_migrations += 1
        raise ApiError(500, f"Migration refused: no connection to the prefill engine {remote!r}.")
    try:
        r = await ds.client().post(
            remote.rstrip("/") + "/_sim/migrate",
            json={"engine_id": ds.local_ids.get(remote), "session_id": m["remote_session_id"], "block_ids": m["remote_block_ids"]},
        )
    except httpx.HTTPError:
        ds.refused_migrations += 1
        raise ApiError(500, "Migration failed: the prefill engine is unreachable.") from None
    if r.status_code != 200:
        ds.refused_migrations += 1
        raise ApiError(500, f"Migration failed: the prefill engine answered {r.status_code}.")
    ds.migrations += 1


async def control(request: Request) -> Response:
    """``GET /_sim/distserve``: the record. ``POST`` arms faults: ``{"fail_next": {"p2p_connect": 1, ...}}``
    (500s from those routes), ``{"exit_after_prefill": true}`` (the process dies once a prefill answer went out
    and a decode instance comes for its blocks)."""
    sim = sim_of(request)
    ds = ds_of(sim)
    if request.method == "POST":
        body = await read_json(request)
        fail = body.get("fail_next", {})
        names = ("engine_info", "p2p_initialize", "p2p_connect")
        if not isinstance(fail, dict) or any(k not in names or type(v) is not int or v < 0 for k, v in fail.items()):
            return json_response({"errors": [f"fail_next: a mapping of {', '.join(names)} to counts >= 0"]}, 400)
        exit_after = body.get("exit_after_prefill", False)
        if not isinstance(exit_after, bool):
            return json_response({"errors": ["exit_after_prefill: true or false"]}, 400)
        ds.fail_next.update(fail)
        ds.exit_after_prefill = exit_after
    return json_response(ds.snapshot())
