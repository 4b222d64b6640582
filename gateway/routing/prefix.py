"""Prompt-prefix keys for prefix affinity, and a bounded memory of the prefixes a backend served.

A request's prompt is read as one string: the text of its leading messages in order (role and
content), capped at ``MAX_PREFIX_CHARS``. The keys are chained hashes of that string cut at fixed
boundaries (256 chars, then growing by √2), so key *i* identifies the first ``BOUNDARIES[i]`` chars.
Two requests that share a system prompt or a document share their leading keys, whatever follows.
The cost is one pass of Python's string hash over at most 8 KiB (about 2 µs) and one slice per key.

Keys are only as stable as ``hash()`` (randomised per process): they are compared inside one
gateway process. Sharing them across replicas would need a fixed hash (e.g. blake2b).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

CHARS_PER_TOKEN = 4
MAX_PREFIX_CHARS = 8192
# 256 chars (about 64 tokens, a few LMDeploy cache blocks) and then ×√2 up to the cap.
BOUNDARIES: tuple[int, ...] = tuple(sorted({int(256 * 2 ** (i / 2)) for i in range(11)}))
assert BOUNDARIES[-1] == MAX_PREFIX_CHARS


def _content(out: list[str], content: Any, room: int) -> int:
    """Count one message's text; append it to ``out`` while the head has ``room``. Media parts count
    as a short marker (their URL's length and tail), so two images differ without hashing megabytes."""
    if isinstance(content, str):
        if room > 0:
            out.append(content)
        return len(content)
    n = 0
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            t = part.get("text")
            if isinstance(t, str):
                if room - n > 0:
                    out.append(t)
                n += len(t)
                continue
            if room - n <= 0:
                continue
            for v in part.values():
                if isinstance(v, dict):
                    v = v.get("url") or v.get("data")
                if isinstance(v, str) and len(v) > 16:
                    out.append(f"\x00{len(v)}:{v[-48:]}\x00")
                    break
    return n


def scan_prompt(body: dict[str, Any]) -> tuple[str, int]:
    """One pass over a request body: (the first ``MAX_PREFIX_CHARS`` of the prompt in the order the
    backend sees it, the number of text characters in the whole prompt)."""
    out: list[str] = []
    n = 0
    for key in ("instructions", "system"):  # Responses / Anthropic Messages put these first
        v = body.get(key)
        if v is not None:
            out.append(key)
            n += _content(out, v, MAX_PREFIX_CHARS - n)
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        msgs = body.get("input")
        if not isinstance(msgs, list):
            msgs = None
    if msgs is not None:
        for m in msgs:
            if isinstance(m, dict):
                if n < MAX_PREFIX_CHARS:
                    out.append(f"\x01{m.get('role')}\x02")
                n += _content(out, m.get("content"), MAX_PREFIX_CHARS - n)
    else:
        for key in ("prompt", "input"):
            v = body.get(key)
            if isinstance(v, str):
                out.append(v)
                n += len(v)
                break
    head = "".join(out)
    return (head if len(head) <= MAX_PREFIX_CHARS else head[:MAX_PREFIX_CHARS]), n


def prefix_keys(head: str) -> tuple[int, ...]:
    """Chained hashes of ``head`` at each boundary it reaches; empty for a prompt under 256 chars."""
    keys: list[int] = []
    h = 0
    start = 0
    n = len(head)
    for end in BOUNDARIES:
        if end > n:
            break
        h = hash((h, head[start:end]))
        keys.append(h)
        start = end
    return tuple(keys)


def key_tokens(depth: int) -> int:
    """Tokens covered by the first ``depth`` keys (0 for none)."""
    return BOUNDARIES[depth - 1] // CHARS_PER_TOKEN if depth > 0 else 0


class PrefixMemory:
    """The prefix keys one backend served recently, in the order of their last use, as the engine's
    prefix cache holds them: an LRU in the KV memory its running sequences leave free.

    Each key stands for its segment of the prompt (the tokens between its boundary and the one
    before) and each prompt's text past its last key for one entry that is never used again (the
    question after a shared document). When a prompt is cached (``add``), the entries past ``room``
    tokens, oldest first, leave the memory as the engine evicts them; the oldest go after ``ttl``
    too. ``capacity`` bounds the entries, so the memory never grows with traffic."""

    __slots__ = ("capacity", "ttl", "_seen", "volume", "_tails")

    def __init__(self, capacity: int = 4096, ttl: float = 600.0):
        self.capacity = capacity
        self.ttl = ttl  # after this long a prefix is assumed evicted from the backend's cache
        self._seen: OrderedDict[Any, tuple[float, float]] = OrderedDict()  # key: (last use, tokens of its segment)
        self.volume = 0.0  # tokens of the entries in _seen
        self._tails = 0  # names the entries of prompt tails

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, keys: tuple[int, ...], now: float, prompt_tokens: float = 0.0, room: float | None = None) -> None:
        """A prompt of ``prompt_tokens`` with ``keys`` was cached at ``now``; the cache holds ``room``
        tokens (None: unknown, only ``ttl`` and ``capacity`` evict)."""
        seen = self._seen
        ends = BOUNDARIES[: len(keys)]
        tail = prompt_tokens - (ends[-1] if ends else 0) / CHARS_PER_TOKEN
        if tail > 0 and room is not None:
            # Oldest first: the engine touches a prompt's blocks last one first, so it evicts the
            # deepest part of a chain before its head (a kept block's predecessors are kept too).
            self._tails += 1
            seen[(None, self._tails)] = (now, tail)
            self.volume += tail
        for i in range(len(keys) - 1, -1, -1):
            size = (ends[i] - (ends[i - 1] if i else 0)) / CHARS_PER_TOKEN
            old = seen.pop(keys[i], None)
            if old is not None:
                self.volume -= old[1]
            seen[keys[i]] = (now, size)
            self.volume += size
        while seen and (len(seen) > self.capacity or (room is not None and self.volume > room)):
            self.volume -= seen.popitem(last=False)[1][1]

    def depth(self, keys: tuple[int, ...], now: float) -> int:
        """How many leading keys this backend served within ``ttl`` (longest match first)."""
        seen = self._seen
        for i in range(len(keys) - 1, -1, -1):
            t = seen.get(keys[i])
            if t is not None and now - t[0] <= self.ttl:
                return i + 1
        return 0

    def clear(self) -> None:
        self._seen.clear()
        self.volume = 0.0
