"""Response bodies and stream frames of the four protocols, built from engine sequences.

Non-streaming bodies are built once the sequences finish. Streams yield one frame (one SSE
event) at a time, one token per frame, as the engine decodes, so fault injection can cut a
stream after exactly K frames.

Usage fields: OpenAI ``prompt_tokens``/``completion_tokens``/``total_tokens`` with
``prompt_tokens_details.cached_tokens``; Responses ``input_tokens``/``output_tokens`` with
``input_tokens_details.cached_tokens``; Anthropic ``input_tokens`` (uncached part),
``cache_read_input_tokens`` and ``output_tokens``, as Anthropic defines them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from .engine import Sequence, wait_any
from .tokens import output_ids, output_text, token_piece


@dataclass(slots=True)
class Job:
    """One API request: ``prompts`` prompts, each generated ``n`` times, in prompt-major order."""

    model: str
    seqs: list[Sequence]
    n: int = 1
    limited: bool = False  # the client set a maximum, so stopping there is "length", not "stop"
    id_hex: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def finish_reason(self) -> str:
        return "length" if self.limited else "stop"

    def finish_of(self, seq: Sequence) -> str:
        return "abort" if seq.aborted else self.finish_reason

    def prompt_heads(self) -> list[Sequence]:
        return self.seqs[:: self.n]

    def prompt_tokens(self) -> int:
        return sum(s.prompt.tokens for s in self.prompt_heads())

    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.prompt_heads())

    def completion_tokens(self) -> int:
        return sum(s.generated for s in self.seqs)

    def openai_usage(self) -> dict[str, Any]:
        prompt, completion = self.prompt_tokens(), self.completion_tokens()
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens()},
        }


def sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_event(event: str, payload: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def progress(seqs: list[Sequence]) -> AsyncIterator[list[tuple[int, int, int, bool]]]:
    """Per engine step, the new tokens of each sequence: ``(index, start, end, finished)``.

    A finished sequence is reported exactly once with ``finished`` set, even with no new token.
    """
    seen = [0] * len(seqs)
    closed = [False] * len(seqs)
    while True:
        batch: list[tuple[int, int, int, bool]] = []
        for i, seq in enumerate(seqs):
            if closed[i]:
                continue
            generated, done = seq.generated, seq.finished
            if generated > seen[i] or done:
                batch.append((i, seen[i], generated, done))
                seen[i] = generated
                closed[i] = done
        if batch:
            yield batch
        if all(closed):
            return
        await wait_any([(seq, seen[i] + 1) for i, seq in enumerate(seqs) if not closed[i]])


# -- OpenAI chat completions ------------------------------------------------------------------


def _head(job: Job, id_prefix: str, kind: str) -> dict[str, Any]:
    return {"id": id_prefix + job.id_hex, "object": kind, "created": job.created, "model": job.model}


def chat_body(job: Job) -> dict[str, Any]:
    return {
        **_head(job, "chatcmpl-", "chat.completion"),
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": output_text(0, s.generated), "tool_calls": None},
                "logprobs": None,
                "finish_reason": job.finish_of(s),
            }
            for i, s in enumerate(job.seqs)
        ],
        "usage": job.openai_usage(),
    }


async def chat_frames(job: Job, include_usage: bool) -> AsyncIterator[bytes]:
    def token(i: int, k: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": token_piece(k)} if k == 0 else {"content": token_piece(k)}
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}

    def end(i: int) -> dict[str, Any]:
        return {"index": i, "delta": {}, "logprobs": None, "finish_reason": job.finish_of(job.seqs[i])}

    base = _head(job, "chatcmpl-", "chat.completion.chunk")
    async for frame in _openai_frames(job, base, include_usage, token, end):
        yield frame


async def _openai_frames(
    job: Job,
    base: dict[str, Any],
    include_usage: bool,
    token: Callable[[int, int], dict[str, Any]],
    end: Callable[[int], dict[str, Any]],
) -> AsyncIterator[bytes]:
    """One chunk per token of choice ``i``, a finish chunk per choice, the usage chunk, ``[DONE]``."""
    async for batch in progress(job.seqs):
        for i, start, stop, done in batch:
            for k in range(start, stop):
                yield sse({**base, "choices": [token(i, k)]})
            if done:  # an admin abort ends the choice with "abort"; a hang-up has stopped the writer already
                yield sse({**base, "choices": [end(i)]})
    if include_usage:
        yield sse({**base, "choices": [], "usage": job.openai_usage()})
    yield SSE_DONE


# -- OpenAI completions -----------------------------------------------------------------------


def completion_body(job: Job) -> dict[str, Any]:
    return {
        **_head(job, "cmpl-", "text_completion"),
        "choices": [
            {"index": i, "text": output_text(0, s.generated), "logprobs": None, "finish_reason": job.finish_of(s)}
            for i, s in enumerate(job.seqs)
        ],
        "usage": job.openai_usage(),
    }


async def completion_frames(job: Job, include_usage: bool) -> AsyncIterator[bytes]:
    def token(i: int, k: int) -> dict[str, Any]:
        return {"index": i, "text": token_piece(k), "logprobs": None, "finish_reason": None}

    def end(i: int) -> dict[str, Any]:
        return {"index": i, "text": "", "logprobs": None, "finish_reason": job.finish_of(job.seqs[i])}

    base = _head(job, "cmpl-", "text_completion")
    async for frame in _openai_frames(job, base, include_usage, token, end):
        yield frame


# -- OpenAI Responses -------------------------------------------------------------------------


def _responses_usage(job: Job) -> dict[str, Any]:
    prompt, completion = job.prompt_tokens(), job.completion_tokens()
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": job.cached_tokens()},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _responses_message(job: Job, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"id": "msg_" + job.id_hex, "type": "message", "status": status, "role": "assistant", "content": content}


def responses_body(job: Job, *, status: str = "completed") -> dict[str, Any]:
    done = status != "in_progress"
    incomplete = done and job.limited
    final_status = "incomplete" if incomplete else status
    return {
        "id": "resp_" + job.id_hex,
        "object": "response",
        "created_at": job.created,
        "status": final_status,
        "model": job.model,
        "output": [_responses_message(job, output_text(0, job.seqs[0].generated), "completed")] if done else [],
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "usage": _responses_usage(job) if done else None,
    }


async def responses_frames(job: Job) -> AsyncIterator[bytes]:
    number = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal number
        frame = sse_event(kind, {"type": kind, "sequence_number": number, **fields})
        number += 1
        return frame

    item_id = "msg_" + job.id_hex
    yield event("response.created", response=responses_body(job, status="in_progress"))
    yield event("response.in_progress", response=responses_body(job, status="in_progress"))
    yield event("response.output_item.added", output_index=0, item=_responses_message(job, "", "in_progress"))
    yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                part={"type": "output_text", "text": "", "annotations": []})
    async for batch in progress(job.seqs):
        for _, start, end, done in batch:
            for k in range(start, end):
                yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=token_piece(k))
            if done and job.seqs[0].aborted:
                return
    text = output_text(0, job.seqs[0].generated)
    part = {"type": "output_text", "text": text, "annotations": []}
    yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text)
    yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=part)
    yield event("response.output_item.done", output_index=0, item=_responses_message(job, text, "completed"))
    final = responses_body(job)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


# -- Anthropic messages -----------------------------------------------------------------------


def _anthropic_usage(job: Job, output_tokens: int) -> dict[str, Any]:
    cached = job.cached_tokens()
    return {
        "input_tokens": job.prompt_tokens() - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def _stop_reason(job: Job) -> str:
    return "max_tokens" if job.limited else "end_turn"


def messages_body(job: Job) -> dict[str, Any]:
    seq = job.seqs[0]
    return {
        "id": "msg_" + job.id_hex,
        "type": "message",
        "role": "assistant",
        "model": job.model,
        "content": [{"type": "text", "text": output_text(0, seq.generated)}],
        "stop_reason": _stop_reason(job),
        "stop_sequence": None,
        "usage": _anthropic_usage(job, seq.generated),
    }


async def messages_frames(job: Job) -> AsyncIterator[bytes]:
    started = False
    async for batch in progress(job.seqs):
        if not started:
            # Sent with the first token: only then is the cached part of the prompt known.
            started = True
            message = {**messages_body(job), "content": [], "stop_reason": None, "usage": _anthropic_usage(job, 0)}
            yield sse_event("message_start", {"type": "message_start", "message": message})
            yield sse_event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
            yield sse_event("ping", {"type": "ping"})
        for _, start, end, done in batch:
            for k in range(start, end):
                yield sse_event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": token_piece(k)}})
            if done and job.seqs[0].aborted:
                return
    yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield sse_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": _stop_reason(job), "stop_sequence": None},
                                      "usage": {"output_tokens": job.completion_tokens()}})
    yield sse_event("message_stop", {"type": "message_stop"})


# -- lmdeploy /generate (SGLang style) --------------------------------------------------------


def _generate_meta(job: Job, seq: Sequence, *, finished: bool, generated: int) -> dict[str, Any]:
    # lmdeploy's GenerateReqMetaOutput (serve/openai/protocol.py), every field, in its order.
    return {
        "prompt_tokens": seq.prompt.tokens,
        "completion_tokens": generated,
        "finish_reason": {"type": job.finish_reason} if finished else None,
        "output_token_logprobs": None,
        "routed_experts": None,
    }


def generate_body(job: Job) -> dict[str, Any]:
    seq = job.seqs[0]
    meta = _generate_meta(job, seq, finished=True, generated=seq.generated)
    return {"text": output_text(0, seq.generated), "output_ids": output_ids(0, seq.generated), "meta_info": meta}


async def generate_frames(job: Job) -> AsyncIterator[bytes]:
    seq = job.seqs[0]
    async for batch in progress(job.seqs):
        for _, start, end, done in batch:
            if done and seq.aborted:
                return
            for k in range(start, end):
                meta = _generate_meta(job, seq, finished=done and k == end - 1, generated=k + 1)
                yield sse({"text": token_piece(k), "output_ids": output_ids(k, k + 1), "meta_info": meta})
            if done and end == start:
                meta = _generate_meta(job, seq, finished=True, generated=end)
                yield sse({"text": "", "output_ids": [], "meta_info": meta})
    yield SSE_DONE
