"""Prompt-prefix keys for prefix affinity, and a bounded memory of the prefixes a backend served.

A request's prompt is read as one string: the text of its leading messages in order (role and
content), capped at ``MAX_PREFIX_CHARS``. The keys are chained hashes of that string cut at fixed
boundaries (256 chars, then growing by √2), so key *i* identifies the first ``BOUNDARIES[i]`` chars.
Two requests that share a system prompt or a document share their leading keys, whatever follows.
The keys are a stable hash (blake2b, 8 bytes, over the UTF-8 text), the same in every process,
so replicas share where a prefix was placed (``gateway/state/cluster.py``). Python's ``hash()`` is
randomised per process and cannot be shared. The cost is one blake2b pass over at most 8 KiB
(microseconds; measured in bench/routing/README.md of 227c192) and one digest per key.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
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
    """Chained hashes of ``head`` at each boundary it reaches; empty for a prompt under 256 chars.

    Key *i* is blake2b of the first ``BOUNDARIES[i]`` chars as a signed 64-bit int: the running
    hash is updated block by block and read at each boundary, so the head is hashed once."""
    n = len(head)
    if n < BOUNDARIES[0]:
        return ()
    keys: list[int] = []
    h = _blake2b(digest_size=8)
    # ASCII (the common case): bytes and chars line up, one encode and zero-copy slices.
    data: Any = memoryview(head.encode("ascii")) if head.isascii() else None
    start = 0
    for end in BOUNDARIES:
        if end > n:
            break
        h.update(data[start:end] if data is not None else head[start:end].encode("utf-8", "surrogatepass"))
        keys.append(int.from_bytes(h.digest(), "little", signed=True))
        start = end
    return tuple(keys)


_blake2b = hashlib.blake2b


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


class Placements:
    """Prefix placements made by this process, waiting to be shared with the other replicas.

    ``record`` is on the request path: one append to a bounded deque (the oldest placements drop
    when nobody drains it, e.g. while Redis is down). ``drain`` (every ``state.load_interval``)
    groups them by backend and drops repeated chains: a shared system prompt is sent once a batch.
    Each chain goes with its prompt's size in tokens: the receiving memory sizes the prompt's tail
    past the last key with it, as for a prompt it placed itself (without, it counted only the keys'
    segments and kept documents the engine had evicted for the tails).

    The same message carries the policy's speed observations (``observe``): each completion's
    seconds per output token and mean batch on its backend, which the other replicas learn from as
    from their own (each learnt σ and γ from a quarter of the completions with four replicas).
    """

    __slots__ = ("_out", "_speeds")

    def __init__(self, capacity: int = 1024):
        self._out: deque[tuple[str, tuple[int, ...], int]] = deque(maxlen=capacity)
        self._speeds: deque[tuple[str, float, float]] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._out) + len(self._speeds)

    def record(self, backend_id: str, keys: tuple[int, ...], tokens: int = 0) -> None:
        self._out.append((backend_id, keys, tokens))

    def observe(self, backend_id: str, y: float, nbar: float) -> None:
        """A completion on ``backend_id``: ``y`` seconds per output token at a mean batch of ``nbar``."""
        self._speeds.append((backend_id, y, nbar))

    def drain_speeds(self) -> dict[str, list[float]]:
        """{backend id: its observations flat, y and n̄ alternating, oldest first}; empties the log."""
        by: dict[str, list[float]] = {}
        out = self._speeds
        while out:
            bid, y, nbar = out.popleft()
            by.setdefault(bid, []).extend((y, nbar))
        return by

    def drain(self) -> dict[str, list[list[int]]]:
        """{backend id: its key chains (each a prompt's leading keys), each once, in the order they were
        placed}; empties the log. Chains, not a flat key list: the receiving memory sizes each key by
        its depth in a chain."""
        return self.drain_sized()[0]

    def drain_sized(self) -> tuple[dict[str, list[list[int]]], dict[str, list[int]]]:
        """``drain``'s chains, and for each backend its chains' prompt tokens in the same order."""
        by: dict[str, dict[tuple[int, ...], int]] = {}
        out = self._out
        while out:
            bid, keys, tokens = out.popleft()
            seen = by.get(bid)
            if seen is None:
                seen = by[bid] = {}
            seen.pop(keys, None)  # re-placed: moves to the end, as in the backend's LRU
            seen[keys] = tokens
        return ({bid: [list(k) for k in chains] for bid, chains in by.items()},
                {bid: list(chains.values()) for bid, chains in by.items()})
