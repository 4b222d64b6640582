"""The policy interface: what a balancing policy is told and what it answers.

A policy sees only eligible backends (the pool filtered them) and a ``RequestInfo``. The router
calls ``pick`` then ``dispatched`` in the same event-loop step (so the pick and the reservation are
atomic within a process), ``first_byte`` when the response starts and ``completed`` exactly once
per dispatch. A retry on another backend is a second ``pick``/``dispatched`` with the same
``RequestInfo`` after the first attempt's ``completed``. ``forget`` drops what the policy keeps
about a backend that left the pool.

Capability flags say what a policy reads, so nobody pays for what it ignores:
- ``reads_prompt``: ``describe`` scans the body (token estimate, prefix keys);
- ``reads_signals``: the gateway polls the backends' /metrics and calls ``observe_signals``;
- ``shares_prefixes``: it keeps a prefix memory per backend; with a shared store the cluster calls
  ``share_placements`` (this replica's placements to publish) and calls ``learn_placements`` with the
  other replicas'. The same log carries its speed observations (``Placements.observe``), which the
  others' ``learn_speeds`` takes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

from ...config.balancer import BalancerConfig
from ..pool import Backend
from ..prefix import BOUNDARIES, CHARS_PER_TOKEN, Placements, prefix_keys, scan_prompt
from ..signals import Signals


@dataclass(slots=True, eq=False)
class RequestInfo:
    model: str
    stream: bool = False
    prompt_tokens: int = 0  # estimated from the body
    max_tokens: int | None = None  # what the client asked for, if it did
    prefix_keys: tuple[int, ...] = ()  # hashes of the prompt's leading blocks, for prefix affinity
    priority: int | None = None  # its key's priority class, set by the gateway queue; None: not known
    # Set by the policy for the current attempt.
    out_tokens: float = field(default=0.0, init=False, repr=False)  # expected completion tokens
    uncached: float = field(default=0.0, init=False, repr=False)  # expected prompt tokens the backend must prefill
    prefill_ahead: float = field(default=0.0, init=False, repr=False)  # prefill tokens queued before this one, incl. its own
    kv_tokens: float = field(default=0.0, init=False, repr=False)  # KV the request holds at its end: prompt + output
    dispatched_at: float = field(default=0.0, init=False, repr=False)
    first_byte_at: float = field(default=0.0, init=False, repr=False)
    area_at: float = field(default=0.0, init=False, repr=False)  # the backend's ∫batch dt when decoding began
    picked: tuple[Backend | None, int] = field(default=(None, 0), init=False, repr=False)  # (backend, prefix depth) from pick


@dataclass(slots=True)
class Outcome:
    status: int  # upstream HTTP status, or 0 when no response arrived
    ok: bool  # a complete, successful response
    ttft: float | None = None  # seconds from dispatch to the first response byte
    prompt_tokens: int | None = None  # from usage, when the response carried it
    completion_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(slots=True, frozen=True)
class Prediction:
    """What a backend is expected to do with one request, in seconds from now."""

    ttft: float  # until its first token: the wait for a slot or KV room, the prefill queue, its own prefill
    e2e: float  # until its last token
    wait: float  # the part of ttft spent waiting for a batch slot or KV room (0 when it starts at once)
    slots: int | None = None  # the backend's batch slots, when known
    free: float = float("inf")  # its batch slots not taken (by ours or others' sequences)
    prefill_ahead: float = 0.0  # seconds of other requests' prefill queued before this one's
    kv_free: float | None = None  # the share of its KV cache left free once this one is in, when the capacity is known


def request_info(model: str, body: dict[str, Any]) -> RequestInfo:
    mt = body.get("max_tokens", body.get("max_completion_tokens", body.get("max_output_tokens")))
    head, chars = scan_prompt(body)
    return RequestInfo(
        model=model,
        stream=body.get("stream") is True,
        prompt_tokens=chars // CHARS_PER_TOKEN + 1,
        max_tokens=mt if isinstance(mt, int) and not isinstance(mt, bool) and mt > 0 else None,
        prefix_keys=prefix_keys(head) if len(head) >= BOUNDARIES[0] else (),
    )


S = TypeVar("S")


class PerBackend(Generic[S]):
    """A policy's typed state per backend id, created on first use and dropped by ``forget``."""

    __slots__ = ("_make", "_items")

    def __init__(self, make: Callable[[], S]):
        self._make = make
        self._items: dict[str, S] = {}

    def __call__(self, b: Backend) -> S:
        s = self._items.get(b.id)
        if s is None:
            s = self._items[b.id] = self._make()
        return s

    def get(self, b: Backend) -> S | None:
        return self._items.get(b.id)

    def forget(self, backend_id: str) -> None:
        self._items.pop(backend_id, None)

    def values(self):
        return self._items.values()

    def __len__(self) -> int:
        return len(self._items)


class Balancer:
    """Base policy: subclasses override ``pick``; bookkeeping of in-flight requests is shared."""

    name = "base"
    reads_prompt = False  # weighs work: needs the prompt scanned (token estimate, prefix keys)
    reads_signals = False  # reads the backends' /metrics gauges
    predicts = False  # answers ``predict`` (the gateway queue needs it to hold requests back)
    shares_prefixes = False  # keeps where prefixes were placed; replicas exchange them (state/cluster.py)

    def __init__(self, config: BalancerConfig | None = None, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        self.config = config or BalancerConfig()
        self.clock = clock
        self.rng = rng or random.Random()
        self.placements: Placements | None = None  # set by share_placements when there are replicas to tell

    def learnt(self, backends: Sequence[Backend]) -> dict[str, Any]:
        """What the policy has learnt of these backends, for operators (the admin listener's
        ``/admin/balancer``) and the benches: plain numbers only."""
        return {"policy": self.name}

    def describe(self, model: str, body: dict[str, Any]) -> RequestInfo:
        """What the policy needs to know of one request."""
        if self.reads_prompt:
            return request_info(model, body)
        return RequestInfo(model=model, stream=body.get("stream") is True)

    def pick(self, candidates: Sequence[Backend], req: RequestInfo) -> Backend:
        raise NotImplementedError

    def predict(self, candidates: Sequence[Backend], req: RequestInfo) -> list[Prediction]:
        """Each candidate's predicted TTFT and end-to-end latency for req (policies with ``predicts``)."""
        raise NotImplementedError(f"{self.name} makes no predictions")

    def starts_at_once(self, backend: Backend, req: RequestInfo) -> bool:
        """True when the policy knows without a prediction that ``backend`` would start req with no
        wait for a batch slot or KV room (``predict`` would say ``wait == 0``); False: ask ``predict``."""
        return False

    def dispatched(self, backend: Backend, req: RequestInfo) -> None:
        backend.in_flight += 1

    def first_byte(self, backend: Backend, req: RequestInfo, ttft: float) -> bool:
        """The response started. True when what the policy learnt from it frees capacity it had
        counted as taken (the router then wakes the gateway queue)."""
        return False

    def completed(self, backend: Backend, req: RequestInfo, outcome: Outcome) -> None:
        backend.in_flight -= 1

    def observe_signals(self, backend: Backend, signals: Signals, changed: bool) -> None:
        """After each poll of a backend's /metrics (only for policies with ``reads_signals``)."""

    def forget(self, backend_id: str) -> None:
        """The backend left the pool: drop what is kept about it."""

    def share_placements(self) -> Placements:
        """From now on record each placement for the other replicas; returns the log the cluster drains."""
        if self.placements is None:
            self.placements = Placements()
        return self.placements

    def learn_placements(self, backend: Backend, chains: Sequence[Sequence[int]], tokens: Sequence[int] | None = None) -> None:
        """Another replica sent requests with these prefix key chains to ``backend`` (``shares_prefixes``);
        ``tokens``: each one's prompt tokens, in the same order (None: an older replica did not say)."""

    def learn_speeds(self, backend: Backend, observations: Sequence[tuple[float, float]]) -> None:
        """Another replica's completions on ``backend``: (seconds per output token, mean batch) each, oldest
        first, from its ``placements`` log (``Placements.observe``)."""

    def shared_load(self, backend: Backend) -> tuple[float, float, float]:
        """What this replica's requests in flight on ``backend`` hold, for the other replicas (the load
        exchange; their ``Backend.remote_kv``, ``remote_decode``, ``remote_prefill``): (KV tokens they
        reserve, output tokens they have left, prompt tokens still to prefill). Zeros: not modelled."""
        return 0.0, 0.0, 0.0

    def _least(self, candidates: Sequence[Backend], score: Callable[[Backend], float]) -> Backend:
        """The lowest score, ties at random."""
        scored = [(score(b), b) for b in candidates]
        best = min(s for s, _ in scored)
        ties = [b for s, b in scored if s <= best]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)
