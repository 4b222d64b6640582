"""Per-key limits and usage: admission after the body is parsed, settling when the response ends.

Admission needs the request's token estimate (prompt + ``max_tokens``), so it runs after the body
filters, just before the router. It is one call to the state store (one Redis round trip with
the shared store, none with the in-memory one), and only for keys that have a limit or budget.
Every forwarded request is settled with the backend's ``usage`` when the response ends; a
response without usage is counted with the gateway's estimate and flagged as such.
See gateway/state/limits.py for the rules.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import Refusal
from ..state import Admission, StateStore
from . import RequestContext

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD = 8  # role, separators and template tokens around each message
REQUEST_OVERHEAD = 8  # the chat template's generation prompt and framing


def estimate_prompt_tokens(body: dict[str, Any] | None) -> int:
    """A cheap upper-leaning estimate: text characters / 4 plus a little per message."""
    if not body:
        return REQUEST_OVERHEAD
    chars = 0
    overhead = 0
    for field in ("prompt", "input", "system", "instructions"):
        v = body.get(field)
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, list):
            chars += _text_chars(v)
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages[:100_000]:
            overhead += MESSAGE_OVERHEAD
            if isinstance(m, dict):
                chars += _text_chars(m.get("content"))
    return -(-chars // CHARS_PER_TOKEN) + overhead + REQUEST_OVERHEAD


def _text_chars(content: Any, depth: int = 0) -> int:
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list) or depth > 3:
        return 0
    n = 0
    for part in content[:10_000]:
        if isinstance(part, str):
            n += len(part)
        elif isinstance(part, dict):
            text = part.get("text")
            if isinstance(text, str):
                n += len(text)
            inner = part.get("content")  # tool results and Anthropic blocks nest their text
            if inner is not None:
                n += _text_chars(inner, depth + 1)
    return n


def max_tokens_of(body: dict[str, Any] | None) -> int | None:
    if not body:
        return None
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(field)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return None


class RateLimit:
    def __init__(self, store: StateStore):
        self.store = store
        self._settling: set[asyncio.Task[None]] = set()

    async def admit(self, ctx: RequestContext) -> Admission | Refusal | None:
        """None: the request is not counted (no key: auth is off)."""
        key = ctx.key
        if key is None:
            return None
        body = ctx.body
        if not key.limited:  # the body is walked for an estimate only if the backend reports no usage
            return self.store.unlimited(key, ctx.model or "", lambda: estimate_prompt_tokens(body))
        return await self.store.admit(key, ctx.model or "", estimate_prompt_tokens(body), max_tokens_of(body))

    def settle(self, adm: Admission, outcome: Any) -> None:
        """Never awaits: a response is not delayed by counting it."""
        self.store.settle(adm, outcome)
