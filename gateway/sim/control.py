"""The simulator's own API under ``/_sim/``: never recorded, never behind the api key.

- ``GET /_sim/requests``: the request log (see ``recorder.py``); ``DELETE`` clears it.
- ``GET /_sim/stats``: engine counters, queue state, armed faults.
- ``POST /_sim/control``: change behaviour at runtime. A body is checked whole before any of it
  applies; keys: ``health``, ``fail_next`` ``{count, status, body?}``, ``drop_next``,
  ``hang_next``, ``crash_stream_after``, ``ttft``, ``tpot``, ``speed``, ``prefill_tokens_per_s``,
  ``batch_slowdown``, ``clear_cache``, ``reset`` (faults off, healthy, timing from the command
  line), ``exit`` (``os._exit(code)`` right after the reply: a crash, no graceful shutdown).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import orjson
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from .errors import json_response
from .faults import HEALTH_STATES, Failure
from .inference import sim_of
from .state import SimState

_TIMING_KEYS = ("ttft", "tpot", "speed", "prefill_tokens_per_s", "batch_slowdown")
_COUNTED_FAULTS = {"drop_next": "drop", "hang_next": "hang"}
_EXIT_DELAY_S = 0.05  # lets the reply leave before the process vanishes


async def list_requests(request: Request) -> Response:
    return json_response(sim_of(request).recorder.snapshot())


async def clear_requests(request: Request) -> Response:
    sim_of(request).recorder.clear()
    return Response(status_code=204)


def stats_of(sim: SimState) -> dict[str, Any]:
    engine, stats = sim.engine, sim.engine.stats
    return {
        "running": len(engine.running),
        "waiting": len(engine.waiting),
        "pending": len(engine.pending),
        "in_flight": engine.in_flight,
        "submitted": stats.submitted,
        "completed": stats.completed,
        "aborted": stats.aborted,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "prefix_hits_tokens": stats.cached_tokens,
        "generation_tokens": stats.generation_tokens,
        "steps": stats.steps,
        "peak_in_flight": stats.peak_in_flight,
        "step_model_s": stats.step_model_s,
        "step_real_s": stats.step_real_s,
        "queue_wait_s": stats.queue_wait_s,
        "admitted": stats.admitted,
        "latency_s": stats.latency_s,
        "first_token_s": stats.first_token_s,
        "kv_reserved_tokens": engine.kv_reserved,
        "kv_usage": engine.kv_usage,
        "prefix_cache_blocks": len(engine.cache),
        "recorded": sim.recorder.total,
        "health": sim.health.status(sim.now()),
        "timing": {k: getattr(sim.timing, k) for k in _TIMING_KEYS},
        "faults": sim.faults.armed(),
        "faults_applied": dict(sim.faults.applied),
    }


async def stats(request: Request) -> Response:
    return json_response(stats_of(sim_of(request)))


async def control(request: Request) -> Response:
    sim = sim_of(request)
    try:
        body = orjson.loads(await request.body() or b"{}")
    except orjson.JSONDecodeError:
        return json_response({"errors": ["the body must be a JSON object"]}, 400)
    if not isinstance(body, dict):
        return json_response({"errors": ["the body must be a JSON object"]}, 400)
    actions, errors = _plan(sim, body)
    if errors:
        return json_response({"errors": errors}, 400)
    for action in actions:
        action()
    background = None
    if "exit" in body:
        background = BackgroundTask(_exit_soon, body["exit"])
    return json_response(stats_of(sim), background=background)


async def _exit_soon(code: int) -> None:
    asyncio.get_running_loop().call_later(_EXIT_DELAY_S, os._exit, code)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _plan(sim: SimState, body: dict[str, Any]) -> tuple[list[Callable[[], None]], list[str]]:
    actions: list[Callable[[], None]] = []
    errors: list[str] = []
    faults, timing = sim.faults, sim.timing
    for key, value in body.items():
        if key == "reset":
            def reset() -> None:
                faults.clear()
                sim.health.set("healthy")
                for name in _TIMING_KEYS:
                    setattr(timing, name, getattr(sim.config, name))
            if value:
                actions.insert(0, reset)  # first, so the other keys of the same body still apply
        elif key == "health":
            if value in HEALTH_STATES:
                actions.append(lambda v=value: sim.health.set(v))
            else:
                errors.append(f"health: must be one of {', '.join(HEALTH_STATES)}")
        elif key == "fail_next":
            failure = _failure(value, errors)
            if failure is not None:
                actions.append(lambda f=failure: setattr(faults, "fail", f if f.remaining else None))
        elif key in ("drop_next", "hang_next"):
            if _count(value):
                actions.append(lambda k=_COUNTED_FAULTS[key], v=value: setattr(faults, k, v))
            else:
                errors.append(f"{key}: must be an integer >= 0")
        elif key == "crash_stream_after":
            if value is None or _count(value):
                actions.append(lambda v=value: setattr(faults, "crash_after", v))
            else:
                errors.append("crash_stream_after: must be an integer >= 0, or null to disarm")
        elif key in _TIMING_KEYS:
            positive = key in ("speed", "prefill_tokens_per_s")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and (value > 0 if positive else value >= 0):
                actions.append(lambda k=key, v=float(value): setattr(timing, k, v))
            else:
                errors.append(f"{key}: must be a number {'> 0' if positive else '>= 0'}")
        elif key == "clear_cache":
            if value:
                actions.append(sim.engine.reset_cache)
        elif key == "exit":
            if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 255):
                errors.append("exit: must be an exit code 0..255")
        else:
            errors.append(f"{key}: unknown control")
    return actions, errors


def _failure(value: Any, errors: list[str]) -> Failure | None:
    if not isinstance(value, dict):
        errors.append("fail_next: must be an object {count, status, body?}")
        return None
    count, status = value.get("count", 1), value.get("status", 503)
    bad = [k for k in value if k not in ("count", "status", "body")]
    if bad:
        errors.append(f"fail_next: unknown keys {bad}")
    if not _count(count):
        errors.append("fail_next.count: must be an integer >= 0")
    if not (isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 599):
        errors.append("fail_next.status: must be an HTTP error status 400..599")
    if bad or not _count(count) or not isinstance(status, int) or not 400 <= status <= 599:
        return None
    return Failure(remaining=count, status=status, body=value.get("body"))
