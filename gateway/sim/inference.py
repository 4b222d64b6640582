"""Handlers of the inference routes: validate like lmdeploy, submit to the engine, answer.

Validation follows the real server where it matters to a gateway: JSON content type, unknown
model (404), the ``anthropic-version`` header, busy ``session_id``, prompts longer than the
session. Anything else a real server would check is accepted as is.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from . import distserve
from .connection import wait_disconnect
from .requests import read_json, require_json_type, sim_of  # noqa: F401  (admin and control import them from here)
from .errors import ApiError, json_response
from .protocol import (
    Job,
    chat_body,
    chat_frames,
    completion_body,
    completion_frames,
    generate_body,
    generate_frames,
    messages_body,
    messages_frames,
    responses_body,
    responses_frames,
)
from .state import SimState
from .streaming import EventStream
from .tokens import (
    Prompt,
    completion_prompts,
    encode,
    output_ids,
    render_anthropic,
    render_chat,
    render_responses,
    text_prompt,
    to_prompt,
)

MAX_N = 128  # lmdeploy's fan-out limit for chat `n`


def resolve_model(sim: SimState, body: dict[str, Any], *, required: bool = True) -> str:
    model = body.get("model")
    if model is None and not required:
        return sim.models[0]
    if not isinstance(model, str):
        raise ApiError(400, "`model` is required and must be a string.", param="model")
    if model not in sim.models:
        raise ApiError(404, f"The model {model!r} does not exist.", param="model")
    return model


def positive_int(body: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"`{key}` must be a positive integer.", param=key)
    return value


def output_budget(sim: SimState, body: dict[str, Any], keys: tuple[str, ...], prompt: Prompt) -> tuple[int, bool]:
    """Tokens to generate, and whether stopping there means "length" (a client-set or context limit)."""
    requested = None
    for key in keys:
        requested = positive_int(body, key)
        if requested is not None:
            break
    room = sim.config.session_len - prompt.tokens
    if room < 1:
        raise ApiError(
            400,
            f"The input token length {prompt.tokens} exceeds the session length {sim.config.session_len}.",
            param="messages",
        )
    if requested is None:
        default = sim.config.default_output_tokens
        return (room, True) if default > room else (default, False)
    return (room, True) if requested > room else (requested, True)


def session_id_of(sim: SimState, body: dict[str, Any]) -> int | None:
    session_id = body.get("session_id")
    if session_id is None or session_id == -1:
        return None
    if isinstance(session_id, bool) or not isinstance(session_id, int):
        raise ApiError(400, "`session_id` must be an integer.", param="session_id")
    if sim.engine.find_session(session_id) is not None:
        raise ApiError(400, f"The session_id {session_id!r} is occupied.", param="session_id")
    return session_id


def submit(
    sim: SimState, model: str, prompts: list[Prompt], n: int, budget: int, limited: bool, session_id: int | None = None, migrated: bool = False
) -> Job:
    engine = sim.engine
    seqs = [engine.submit(p, budget, session_id, migrated) for p in prompts for _ in range(n)]
    return Job(model=model, seqs=seqs, n=n, limited=limited)


def abort_job(sim: SimState, job: Job) -> None:
    for seq in job.seqs:
        sim.engine.abort(seq)


async def finished(sim: SimState, job: Job, request: Request) -> bool:
    """Wait for every sequence; False (and the work aborted) if the client hung up first."""
    if all(s.finished for s in job.seqs):
        return True  # instant mode: no tasks at all

    async def all_done() -> None:
        for seq in job.seqs:
            await seq.wait_done()

    done = asyncio.ensure_future(all_done())
    hangup = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait((done, hangup), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (done, hangup):
            if not task.done():
                task.cancel()
    if done.done() and not done.cancelled():
        return True
    abort_job(sim, job)
    return False


async def answer(
    sim: SimState,
    request: Request,
    job: Job,
    body: dict[str, Any],
    frames: Callable[[Job], AsyncGenerator[bytes, None]],
    whole: Callable[[Job], dict[str, Any]],
) -> Response:
    """Stream the job's frames, or wait for it and send the whole body."""
    if body.get("stream"):
        return EventStream(frames(job), lambda: abort_job(sim, job), crash_after=sim.faults.take_crash())
    if not await finished(sim, job, request):
        return Response(status_code=499)  # nobody reads it: the client already left
    return json_response(whole(job))


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _prompt(sim: SimState, text: str) -> Prompt:
    return text_prompt(text, sim.config.block_tokens)


# -- routes ------------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    sim = sim_of(request)
    body = await read_json(request)
    model = resolve_model(sim, body)
    prompt = _prompt(sim, render_chat(body))
    n = positive_int(body, "n", 1) or 1
    if n > MAX_N:
        raise ApiError(400, f"`n` must be at most {MAX_N}.", param="n")
    budget, limited = output_budget(sim, body, ("max_completion_tokens", "max_tokens"), prompt)
    migrated, whole = await _disaggregation(sim, body, prompt, chat_body)
    job = submit(sim, model, [prompt], n, budget, limited, session_id_of(sim, body), migrated)
    include_usage = _include_usage(body)
    return await answer(sim, request, job, body, lambda j: chat_frames(j, include_usage), whole)


async def completions(request: Request) -> Response:
    sim = sim_of(request)
    body = await read_json(request)
    model = resolve_model(sim, body)
    prompts = [to_prompt(p, sim.config.block_tokens) for p in completion_prompts(body.get("prompt"))]
    n = positive_int(body, "n", 1) or 1
    if n * len(prompts) > MAX_N:
        raise ApiError(400, f"`n` times the number of prompts must be at most {MAX_N}.", param="n")
    budget, limited = output_budget(sim, body, ("max_tokens",), max(prompts, key=lambda p: p.tokens))
    migrated, whole = await _disaggregation(sim, body, prompts[0], completion_body)
    job = submit(sim, model, prompts, n, budget, limited, session_id_of(sim, body), migrated)
    include_usage = _include_usage(body)
    return await answer(sim, request, job, body, lambda j: completion_frames(j, include_usage), whole)


async def _disaggregation(
    sim: SimState, body: dict[str, Any], prompt: Prompt, whole: Callable[[Job], dict[str, Any]]
) -> tuple[bool, Callable[[Job], dict[str, Any]]]:
    """lmdeploy's engine knobs for PD: ``migration_request`` (decode: pull the KV, skip prefill) and
    ``with_cache``/``preserve_cache`` (prefill: answer with the blocks and keep them)."""
    migration = distserve.parse_migration(body)
    with_cache = bool(body.pop("with_cache", False))
    body.pop("preserve_cache", None)
    if migration is not None:
        await distserve.migrate_in(sim, migration)
    if not with_cache:
        return migration is not None, whole

    def with_blocks(job: Job) -> dict[str, Any]:
        out = whole(job)
        seq = job.seqs[0]
        if not seq.aborted:
            out.update(distserve.with_cache_fields(distserve.hold(sim, prompt.tokens), output_ids(0, max(1, seq.generated))[-1]))
        return out

    return migration is not None, with_blocks


_RESPONSES_UNSUPPORTED = ("background", "context_management", "conversation", "previous_response_id", "prompt")


async def responses(request: Request) -> Response:
    sim = sim_of(request)
    body = await read_json(request)
    for key in _RESPONSES_UNSUPPORTED:
        if body.get(key):
            raise ApiError(400, f"{key} is not supported by Responses Text V1.", param=key)
    model = resolve_model(sim, body, required=False)
    prompt = _prompt(sim, render_responses(body))
    budget, limited = output_budget(sim, body, ("max_output_tokens",), prompt)
    job = submit(sim, model, [prompt], 1, budget, limited)
    return await answer(sim, request, job, body, responses_frames, responses_body)


def _anthropic_checks(sim: SimState, request: Request, body: dict[str, Any]) -> str:
    if not request.headers.get("anthropic-version"):
        raise ApiError(400, "Missing required header: anthropic-version")
    try:
        return resolve_model(sim, body)
    except ApiError as exc:
        if exc.status == 404:
            raise ApiError(404, exc.message, type="not_found_error") from None
        raise


async def messages(request: Request) -> Response:
    sim = sim_of(request)
    body = await read_json(request)
    model = _anthropic_checks(sim, request, body)
    if body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens: Field required", param="max_tokens")
    prompt = _prompt(sim, render_anthropic(body))
    budget, limited = output_budget(sim, body, ("max_tokens",), prompt)
    job = submit(sim, model, [prompt], 1, budget, limited)
    return await answer(sim, request, job, body, messages_frames, messages_body)


async def count_tokens(request: Request) -> Response:
    sim = sim_of(request)
    body = await read_json(request)
    _anthropic_checks(sim, request, body)
    return json_response({"input_tokens": _prompt(sim, render_anthropic(body)).tokens})


async def generate(request: Request) -> Response:
    sim = sim_of(request)
    body = await read_json(request)
    source: str | list[int]
    if isinstance(body.get("input_ids"), list) and body["input_ids"]:
        source = body["input_ids"]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in source):
            raise ApiError(400, "`input_ids` must be a list of integers.", param="input_ids")
    elif isinstance(body.get("prompt"), str):
        source = body["prompt"]
    else:
        raise ApiError(400, "Either `prompt` or `input_ids` is required.", param="prompt")
    prompt = to_prompt(source, sim.config.block_tokens)
    # lmdeploy's GenerateReqInput: max_tokens, default 128 (SGLang's sampling_params.max_new_tokens also read).
    params = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}
    merged = {"max_tokens": 128, **body, **params}
    budget, limited = output_budget(sim, merged, ("max_new_tokens", "max_tokens"), prompt)
    job = submit(sim, sim.models[0], [prompt], 1, budget, limited, session_id_of(sim, body))
    return await answer(sim, request, job, body, generate_frames, generate_body)


# -- auxiliary routes (no engine time) ---------------------------------------------------------


async def embeddings(request: Request) -> Response:
    await read_json(request)
    raise ApiError(400, "Unsupported by turbomind.")


async def encode_route(request: Request) -> Response:
    body = await read_json(request)
    inp = body.get("input")
    bos = [1] if body.get("add_bos", True) else []
    if isinstance(inp, str):
        ids = bos + encode(inp)
        return json_response({"input_ids": ids, "length": len(ids)})
    if isinstance(inp, list) and all(isinstance(p, str) for p in inp):
        batch = [bos + encode(p) for p in inp]
        return json_response({"input_ids": batch, "length": [len(ids) for ids in batch]})
    raise ApiError(400, "`input` must be a string or a list of strings.", param="input")


def _score(data: object) -> float:
    return zlib.crc32(orjson.dumps(data)) % 10_000 / 1000.0


async def pooling(request: Request) -> Response:
    sim = sim_of(request)
    body = await read_json(request)
    model = resolve_model(sim, body, required=False)
    inp = body.get("input")
    if isinstance(inp, str):
        batch: list[Any] = [encode(inp)]
    elif isinstance(inp, list) and inp:
        if isinstance(inp[0], str):
            batch = [encode(p) for p in inp]
        elif isinstance(inp[0], int):
            batch = [inp]
        elif isinstance(inp[0], list):
            batch = inp
        else:
            raise ApiError(400, "Input list contains an invalid type.")
    elif isinstance(inp, list):
        raise ApiError(400, "Input list cannot be empty.")
    else:
        raise ApiError(400, "Input must be a string or a list.")
    tokens = sum(len(ids) for ids in batch)
    # lmdeploy's PoolingResponse(...).model_dump(), with UsageInfo.build(prompt_tokens, 0, cached_tokens=0).
    return json_response(
        {
            "id": f"pool-{uuid.uuid4().hex[:22]}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "pooling", "data": _score(ids)} for i, ids in enumerate(batch)],
            "usage": {
                "prompt_tokens": tokens,
                "total_tokens": tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": None,
            },
        }
    )


async def get_ppl(request: Request) -> Response:
    body = await read_json(request)
    inp = body.get("input")
    ids = encode(inp) if isinstance(inp, str) else inp
    if not isinstance(ids, list) or not ids:
        raise ApiError(400, "Input must not be empty.", param="input")
    return json_response({"ppl": 1.0 + _score(ids)})
