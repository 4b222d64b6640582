"""The simulated inference engine: continuous batching on one asyncio step loop.

The cost model, at ``speed`` 1:

- a request waits ``ttft`` before it reaches the engine (tokenising, templating: off the GPU);
- it then queues until a batch slot is free and the KV cache can hold its prompt plus its whole
  output (reserved at admission, so a running sequence is never preempted);
- one engine step costs ``uncached_prompt_tokens_admitted / prefill_tokens_per_s``
  ``+ tpot * (1 + batch_size * batch_slowdown)``; every running sequence gets one token per step,
  a newly admitted one its first token (prefill emits it);
- prompt blocks found in the prefix cache skip prefill; a sequence's blocks enter the cache after
  its prefill step. The cache may only use KV memory that running sequences do not reserve.

``speed`` divides every time. With ``ttft == tpot == 0`` the engine is "instant": ``submit``
returns a finished sequence with no task, no timer and no await, for overhead benchmarks.

The loop runs only while there is work, and steps follow an absolute clock, so timer slack in
one step is paid back in the next instead of adding up.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .prefix_cache import PrefixCache
from .tokens import Prompt

# Sequence states.
PENDING, WAITING, RUNNING, FINISHED = "pending", "waiting", "running", "finished"

_FOREVER = 1 << 62


@dataclass(slots=True)
class Timing:
    """Mutable at runtime through ``POST /_sim/control``; the step loop reads it every step."""

    ttft: float
    tpot: float
    speed: float
    prefill_tokens_per_s: float
    batch_slowdown: float
    # A cold engine: its first ``cold_steps`` steps take ``cold_factor`` times as long (a real
    # api_server's first batches run before its kernels are warm: on an H200 with the pytorch
    # backend in eager mode, the first batch of 8 took 3 s and the next ones 0.6 s).
    cold_steps: int = 0
    cold_factor: float = 1.0

    @property
    def instant(self) -> bool:
        return self.ttft == 0 and self.tpot == 0


def step_seconds(timing: Timing, uncached_prompt_tokens: int, batch_size: int) -> float:
    """The cost of one engine step: prefill of the newly admitted tokens plus one decode pass."""
    prefill = uncached_prompt_tokens / timing.prefill_tokens_per_s
    decode = timing.tpot * (1 + batch_size * timing.batch_slowdown)
    return (prefill + decode) / timing.speed


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_batch_size: int
    kv_capacity_tokens: int
    block_tokens: int


@dataclass(slots=True)
class EngineStats:
    submitted: int = 0
    completed: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    peak_in_flight: int = 0  # the most sequences it held at once (tests: did anyone overfill its batch)
    # The model's step seconds against the loop's real ones (a busy CPU makes steps late), and the
    # seconds sequences waited in the queue for a slot: what the routing bench compares with its replay.
    step_model_s: float = 0.0
    step_real_s: float = 0.0
    queue_wait_s: float = 0.0
    admitted: int = 0
    latency_s: float = 0.0  # summed over completed sequences: submit to last token, submit to first
    first_token_s: float = 0.0


class EngineObserver(Protocol):
    def on_admitted(self, seq: Sequence) -> None: ...
    def on_finished(self, seq: Sequence) -> None: ...


class Sequence:
    """One generation: ``generated`` grows by one per engine step until ``max_new_tokens``."""

    __slots__ = (
        "id", "prompt", "max_new_tokens", "session_id", "state", "generated", "cached_tokens",
        "finish_reason", "submitted_at", "first_token_at", "finished_at", "_waiters", "_timer", "migrated",
    )

    def __init__(self, seq_id: int, prompt: Prompt, max_new_tokens: int, session_id: int | None, now: float) -> None:
        self.id = seq_id
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.session_id = session_id
        self.state = PENDING
        self.generated = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None  # "length" when it ran to max_new_tokens, "abort"
        self.submitted_at = now
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self.migrated = False  # its KV came from a prefill instance: no prefill here

    @property
    def finished(self) -> bool:
        return self.state is FINISHED

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @property
    def kv_tokens(self) -> int:
        return self.prompt.tokens + self.max_new_tokens

    async def wait_for(self, tokens: int) -> None:
        """Return once ``generated >= tokens`` or the sequence has finished."""
        await wait_any(((self, tokens),))

    async def wait_done(self) -> None:
        await self.wait_for(_FOREVER)

    def _wake(self) -> None:
        if not self._waiters:
            return
        done = self.state is FINISHED
        keep = []
        for tokens, fut in self._waiters:
            if done or self.generated >= tokens:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((tokens, fut))
        self._waiters = keep


async def wait_any(targets: Iterable[tuple[Sequence, int]]) -> None:
    """Return once any of the sequences has ``tokens`` tokens or has finished.

    One future is shared by all of them; a sequence drops it once done, so no cleanup is needed.
    """
    targets = tuple(targets)
    for seq, tokens in targets:
        if seq.generated >= tokens or seq.state is FINISHED:
            return
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    for seq, tokens in targets:
        seq._waiters.append((tokens, fut))
    await fut


class Engine:
    def __init__(self, timing: Timing, limits: EngineLimits, observer: EngineObserver | None = None) -> None:
        self.timing = timing
        self.limits = limits
        self.observer = observer
        self.cache = PrefixCache()
        self.stats = EngineStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pending: set[Sequence] = set()  # inside their ttft delay
        self.kv_reserved = 0
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- public API ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.pending) + len(self.waiting) + len(self.running)

    @property
    def kv_usage(self) -> float:
        return self.kv_reserved / self.limits.kv_capacity_tokens

    def submit(self, prompt: Prompt, max_new_tokens: int, session_id: int | None = None, migrated: bool = False) -> Sequence:
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        seq = Sequence(next(self._ids), prompt, max(1, max_new_tokens), session_id, loop.time())
        seq.migrated = migrated
        self.stats.submitted += 1
        timing = self.timing
        if timing.instant:
            self._run_instantly(seq)
            return seq
        self.pending.add(seq)
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.in_flight)
        delay = timing.ttft / timing.speed
        if delay > 0:
            seq._timer = loop.call_later(delay, self._enqueue, seq)
        else:
            self._enqueue(seq)
        return seq

    def abort(self, seq: Sequence) -> bool:
        """Stop a sequence wherever it is and free its slot. False if it had already finished."""
        if seq.state is FINISHED:
            return False
        if seq.state is PENDING:
            self.pending.discard(seq)
            if seq._timer is not None:
                seq._timer.cancel()
        elif seq.state is WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.kv_reserved -= seq.kv_tokens
        self.stats.aborted += 1
        self._finish(seq, "abort")
        return True

    def abort_all(self) -> int:
        victims = [*self.pending, *self.waiting, *self.running]
        return sum(self.abort(s) for s in victims)

    def find_session(self, session_id: int) -> Sequence | None:
        for seq in itertools.chain(self.running, self.waiting, self.pending):
            if seq.session_id == session_id:
                return seq
        return None

    def reset_cache(self) -> None:
        self.cache.clear()

    # -- scheduling ---------------------------------------------------------------------------

    def _run_instantly(self, seq: Sequence) -> None:
        blocks = self.limits.block_tokens
        seq.cached_tokens = self._cached(seq)
        self._account_admission(seq)
        self.cache.insert(seq.prompt.blocks, self._cache_room())
        seq.generated = seq.max_new_tokens
        seq.first_token_at = seq.submitted_at
        self.stats.completed += 1
        self._finish(seq, "length")

    def _enqueue(self, seq: Sequence) -> None:
        if seq.state is not PENDING:
            return
        self.pending.discard(seq)
        seq._timer = None
        seq.state = WAITING
        self.waiting.append(seq)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()
        stats = self.stats
        try:
            while self.waiting or self.running:
                began = loop.time()
                admitted = self._admit()
                if not self.running:
                    continue  # the queue was empty too: the while condition ends the loop
                uncached = sum(s.prompt.tokens - s.cached_tokens for s in admitted)
                step = step_seconds(self.timing, uncached, len(self.running))
                if stats.steps < self.timing.cold_steps:
                    step *= self.timing.cold_factor
                clock = max(clock, began) + step
                await asyncio.sleep(max(0.0, clock - loop.time()))
                now = loop.time()
                stats.step_model_s += step
                stats.step_real_s += now - began
                self._advance(admitted, now)
        finally:
            self._task = None

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        limits = self.limits
        while self.waiting and len(self.running) < limits.max_batch_size:
            seq = self.waiting[0]
            # A sequence larger than the whole cache still runs alone rather than block the queue forever.
            if self.running and self.kv_reserved + seq.kv_tokens > limits.kv_capacity_tokens:
                break
            self.waiting.popleft()
            seq.state = RUNNING
            self.stats.admitted += 1
            self.stats.queue_wait_s += self._loop.time() - seq.submitted_at - self.timing.ttft / self.timing.speed
            seq.cached_tokens = self._cached(seq)
            self.kv_reserved += seq.kv_tokens
            self.running.append(seq)
            admitted.append(seq)
            self._account_admission(seq)
        if admitted:
            self.cache.shrink(self._cache_room())
        return admitted

    def _advance(self, admitted: list[Sequence], now: float) -> None:
        self.stats.steps += 1
        room = self._cache_room()
        for seq in admitted:
            if seq.state is RUNNING:
                self.cache.insert(seq.prompt.blocks, room)
        done: list[Sequence] = []
        for seq in self.running:
            seq.generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
            if seq.generated >= seq.max_new_tokens:
                done.append(seq)
            else:
                seq._wake()
        if done:
            self.running = [s for s in self.running if s.generated < s.max_new_tokens]
            for seq in done:
                self.kv_reserved -= seq.kv_tokens
                self.stats.completed += 1
                self._finish(seq, "length")
                self.stats.latency_s += seq.finished_at - seq.submitted_at
                self.stats.first_token_s += seq.first_token_at - seq.submitted_at

    def _cached(self, seq: Sequence) -> int:
        if seq.migrated:  # the prompt's KV arrived by migration: nothing to prefill
            return seq.prompt.tokens
        return min(self.cache.match(seq.prompt.blocks) * self.limits.block_tokens, seq.prompt.tokens - 1)

    def hold(self, tokens: int) -> None:
        """KV kept for a prefill session until it is migrated or freed (``preserve_cache``)."""
        self.kv_reserved += tokens

    def release(self, tokens: int) -> None:
        self.kv_reserved = max(0, self.kv_reserved - tokens)

    def _cache_room(self) -> int:
        return max(0, self.limits.kv_capacity_tokens - self.kv_reserved) // self.limits.block_tokens

    def _account_admission(self, seq: Sequence) -> None:
        self.stats.prompt_tokens += seq.prompt.tokens
        self.stats.cached_tokens += seq.cached_tokens
        if self.observer is not None:
            self.observer.on_admitted(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.state = FINISHED
        seq.finish_reason = reason
        seq.finished_at = self._loop.time() if self._loop else None
        self.stats.generation_tokens += seq.generated
        if self.observer is not None:
            self.observer.on_finished(seq)
        seq._wake()
