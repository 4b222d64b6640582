"""Choosing the two instances of a disaggregated (prefill/decode) request.

- **Prefill** by predicted time to first token: what is left of this gateway's prefills on the
  instance (their predicted seconds less the time the first of them has run) plus the new prompt's.
  A prefill's seconds are the instance's learnt fixed cost plus its learnt cost per token, fitted
  only on prefills that started on an idle instance: a prefill that queued behind others would teach
  its queueing as speed, which the outstanding work already counts (with one rate learnt from every
  prefill, a busy instance looked up to twice as slow per token as it is, held interactive requests in the
  gateway and sent them behind batch prefills: bench/routing/README.md of 227c192, "Mixed priority in PD mode"). Prefix
  affinity: a prompt whose start this gateway sent lately prefers the instance it went to then (its
  prefix cache may hold it), as long as that costs at most ``affinity_slack`` seconds over the best
  choice, so the cache is reused without piling work on one instance. A start not seen lately has
  no cache to prefer: it goes to the best choice (ties by rendezvous hashing on the start, so alike
  prompts from other replicas meet). Affinity once held every prompt to a hashed home: an
  interactive prompt then waited up to the slack, often behind a batch prefill, for nothing.
- **Decode** by decode load and KV room: fewer running decodes first, weighted by how full the KV
  cache would be with this request (capacity from ``/distserve/engine_info``: blocks x block size);
  an instance that cannot hold the request is used only when none can, one without a free batch slot
  only when none has one (then the one whose slot is predicted to free first).

State is the picker's own (keyed by backend id), learnt from what the dispatcher reports.

For the gateway queue (``queue.Admission``) the picker is the binder of the prefill phase:
``pick``/``dispatched``/``completed`` as a balancing policy's, and ``room``: the prefill instances
that can start a request now. An instance has room while it has a free batch slot (its ``slots``
less this gateway's and the other replicas' requests on it) and its predicted prefill queue is
within ``hold``; an idle one always has. Nothing starts while no decode instance has KV room for
the request (unless one is idle), nor while the decode side has no batch slot for it: the free slots
of the decode instances with KV room (each one's slots less every replica's decodes on it), now or
predicted within ``hold`` after its own prefill is predicted done, must exceed the requests already prefilling (every replica's: each
takes a decode slot when its prefill is done). So a burst waits in the gateway, not in full decode
batches. A decode instance's slots: ``balancer.slots``, else the launcher's (the group's
``max_batch_size``), raised by what its /metrics show (``signals.learn_slots``); unknown, it
limits nothing. A slot is predicted to free when a decode running there is due to end: its output
tokens (``max_tokens``) from its first at the instance's learnt seconds per output token. The queue
is woken when that time comes (``PDDispatcher``): no response ends then to wake it.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .policies import Outcome, RequestInfo
from .pool import Backend
from .signals import Signals, learn_slots

DEFAULT_SECONDS_PER_TOKEN = 1 / 20000  # until the first prefill on an instance is measured
EWMA = 0.2
FIT_EWMA = 0.05  # the prefill fit's weight of a new sample: about the last 20 idle starts
AFFINITY_PREFIX_BYTES = 512  # the start of the prompt that decides affinity
AFFINITY_MEMORY = 4096  # prompt starts remembered with the instance they went to last


@dataclass
class PrefillFit:
    """Seconds of one prefill on an idle instance = fixed + per_token x tokens, by exponentially
    weighted least squares. Fixed costs (a step's decode pass, the hops) are why one rate misleads:
    learnt from short prompts it overcharges long ones, and instances fed different prompt lengths
    (interactive ones, batch ones) look different in speed when they are alike."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        keep = 1.0 - FIT_EWMA if self.n else 0.0
        self.n = self.n * keep + 1.0
        self.x = self.x * keep + tokens
        self.y = self.y * keep + seconds
        self.xx = self.xx * keep + tokens * tokens
        self.xy = self.xy * keep + tokens * seconds

    def model(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token); one rate through the origin while the prompts seen
        are too alike in length to tell the two apart, the prior before any."""
        if not self.n or self.x <= 0:
            return 0.0, DEFAULT_SECONDS_PER_TOKEN
        mx, my = self.x / self.n, self.y / self.n
        var = self.xx / self.n - mx * mx
        if var > (0.1 * mx) ** 2:  # lengths spread by more than 10 %
            slope = (self.xy / self.n - mx * my) / var
            fixed = my - slope * mx
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, my / mx

    def seconds(self, tokens: int, count: int = 1) -> float:
        fixed, per_token = self.model()
        return count * fixed + tokens * per_token


@dataclass
class _PrefillState:
    outstanding_tokens: int = 0
    outstanding: int = 0  # this gateway's prefills on it
    since: float = 0.0  # when the first of them started: when it went busy, or the last one ended
    solo_tokens: int | None = None  # the prefill that started on it idle, until the next one ends
    fit: PrefillFit = field(default_factory=PrefillFit)


@dataclass(slots=True, eq=False)
class DecodeRun:
    """One decode of this gateway on an instance: when it is due to end is predicted from it."""

    started: float
    out_tokens: int  # the output it may produce (max_tokens, or the picker's default)
    first_at: float | None = None  # its first token (a stream's): before it, it migrates or waits for a slot

    def due(self, now: float, seconds_per_token: float) -> float:
        """When it is predicted to end: its output at the instance's speed from its first token
        (from now while it has none: a decode that waits has all of its output ahead)."""
        return (self.first_at if self.first_at is not None else max(now, self.started)) + self.out_tokens * seconds_per_token


@dataclass
class _DecodeState:
    running: int = 0
    reserved_tokens: int = 0
    capacity_tokens: int | None = None  # from /distserve/engine_info
    learnt_slots: int | None = None  # from /metrics
    seconds_per_token: float | None = None  # per output token from the first, learnt from finished decodes
    runs: list[DecodeRun] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class PDRequest(RequestInfo):
    """A disaggregated request as the queue and the picker see it."""

    prompt: bytes = field(default=b"", repr=False)  # the start decides prefix affinity
    decode_tokens: int = 0  # KV it will hold on the decode instance: prompt + output
    out_tokens: int = 0  # output tokens it may produce: how long its decode holds a slot


class PDPicker:
    def __init__(self, affinity_slack: float = 0.25, slots: int | None = None, clock: Callable[[], float] = time.monotonic):
        """slots: every instance's batch slots when configured (``balancer.slots``)."""
        self.affinity_slack = affinity_slack
        self.slots = slots
        self.clock = clock
        self._prefill: dict[str, _PrefillState] = {}
        self._placed: OrderedDict[bytes, str] = OrderedDict()  # a prompt start's digest -> the instance it went to last
        self._decode: dict[str, _DecodeState] = {}

    # -- prefill -------------------------------------------------------------------------------
    def predicted_wait(self, b: Backend, tokens: int) -> float:
        """Seconds until a prefill of ``tokens`` sent to b now is done: what is left ahead, then its own."""
        st = self._prefill.get(b.id)
        if st is None:
            return PrefillFit().seconds(tokens)
        return self._left(st) + st.fit.seconds(tokens)

    def _left(self, st: _PrefillState) -> float:
        """Seconds left of this gateway's prefills on an instance: the first has run since ``since``."""
        if not st.outstanding:
            return 0.0
        return max(0.0, st.fit.seconds(st.outstanding_tokens, st.outstanding) - (self.clock() - st.since))

    def pick_prefill(self, candidates: list[Backend], tokens: int, prefix: bytes) -> Backend:
        waits = {b.id: self.predicted_wait(b, tokens) for b in candidates}
        if not prefix:
            return min(candidates, key=lambda b: (waits[b.id], b.in_flight))
        head = prefix[:AFFINITY_PREFIX_BYTES]
        best = min(candidates, key=lambda b: (waits[b.id], b.in_flight, hashlib.blake2b(head + b.id.encode(), digest_size=8).digest()))
        key = hashlib.blake2b(head, digest_size=16).digest()
        last = self._placed.pop(key, None)
        home = next((b for b in candidates if b.id == last), None)
        chosen = home if home is not None and waits[home.id] <= waits[best.id] + self.affinity_slack else best
        self._placed[key] = chosen.id
        if len(self._placed) > AFFINITY_MEMORY:
            self._placed.popitem(last=False)
        return chosen

    def wait_ahead(self, b: Backend) -> float:
        """Seconds of this gateway's prefill still ahead on b (what is left of the running one included)."""
        st = self._prefill.get(b.id)
        return self._left(st) if st is not None else 0.0

    # -- the queue's binder (the prefill phase) ----------------------------------------------------
    def pick(self, candidates: Sequence[Backend], req: PDRequest) -> Backend:
        return self.pick_prefill(list(candidates), req.prompt_tokens, req.prompt)

    def dispatched(self, b: Backend, req: PDRequest) -> None:
        """The prefill is b's from now (bound by the queue or picked on a retry)."""
        self.prefill_started(b, req.prompt_tokens)
        b.in_flight += 1

    def completed(self, b: Backend, req: PDRequest, outcome: Outcome) -> None:
        """Exactly once per ``dispatched``; ``outcome.ttft`` is the prefill's time when it succeeded."""
        b.in_flight -= 1
        self.prefill_done(b, req.prompt_tokens, outcome.ttft if outcome.ok else None)

    def prefill_fits(self, b: Backend, hold: float, reserve: float) -> bool:
        busy = b.in_flight + b.remote_in_flight  # every replica's requests take its slots
        if b.slots is not None and b.slots - busy < 1 + int(reserve * b.slots):
            return False
        return busy == 0 or self.wait_ahead(b) <= hold

    def decode_fits(self, d: Backend, tokens: int) -> bool:
        return d.in_flight + d.remote_in_flight == 0 or self.decode_score(d, tokens)[0] == 0

    def decode_slot_in(self, decodes: Sequence[Backend], prefilling: int) -> float:
        """Seconds until the decode instances are predicted to have a batch slot for one more request
        beyond ``prefilling`` (requests whose prefill runs: each takes one when done): 0 when free now,
        inf when not predicted. An instance whose slots are unknown limits nothing."""
        now = self.clock()
        free = 0
        ends: list[float] = []
        for d in decodes:
            slots = self.decode_slots(d)
            if slots is None:
                return 0.0
            busy = d.in_flight + d.remote_in_flight  # every replica's decodes take its slots
            free += max(0, slots - busy)
            st = self._decode.get(d.id)
            if st is not None and st.seconds_per_token is not None:
                due = sorted(max(0.0, r.due(now, st.seconds_per_token) - now) for r in st.runs)
                ends += due[max(0, busy - slots):]  # the first to end only bring an over-full instance back to its slots
        if free > prefilling:
            return 0.0
        ends.sort()
        k = prefilling - free  # ends before the one that frees a slot for this request
        return ends[k] if k < len(ends) else math.inf

    def room_or_wait(self, prefills: Sequence[Backend], decodes: Sequence[Backend], req: PDRequest, hold: float, reserve: float = 0.0) -> tuple[list[Backend], float]:
        """``room``, and when it is empty only for want of a decode slot, the seconds until one is
        predicted in time (inf otherwise): nothing else may wake the queue then."""
        fits = [d for d in decodes if self.decode_fits(d, req.decode_tokens)]
        ready = [b for b in prefills if self.prefill_fits(b, hold, reserve)]
        if not fits or not ready:
            return [], math.inf
        prefilling = sum(b.in_flight + b.remote_in_flight for b in prefills)  # every replica's
        # Its decode starts once its prefill is done: a slot that frees by then (plus hold) is in time,
        # and the prefill overlaps the wait for it instead of following it.
        lead = min(self.predicted_wait(b, req.prompt_tokens) for b in ready)
        wait = self.decode_slot_in(fits, prefilling) - hold - lead
        return (ready, 0.0) if wait <= 0 else ([], wait)

    def room(self, prefills: Sequence[Backend], decodes: Sequence[Backend], req: PDRequest, hold: float, reserve: float = 0.0) -> list[Backend]:
        """The prefill instances that can start req now: a free slot, at most ``hold`` seconds of
        prefill queued, a decode instance with KV room for it and a decode slot for it
        (``decode_slot_in``) by the time its prefill is done, within ``hold``. ``reserve``: the share
        of each prefill instance's slots to leave free (classes below interactive while interactive come)."""
        return self.room_or_wait(prefills, decodes, req, hold, reserve)[0]

    def prefill_started(self, b: Backend, tokens: int) -> None:
        st = self._prefill.setdefault(b.id, _PrefillState())
        if not st.outstanding:
            st.since = self.clock()
            # Idle (no other replica's request on it either): its time will be its own work alone.
            st.solo_tokens = tokens if b.remote_in_flight == 0 else None
        st.outstanding += 1
        st.outstanding_tokens += tokens

    def prefill_done(self, b: Backend, tokens: int, seconds: float | None) -> None:
        """seconds: the prefill's time when it succeeded. Only one that started on an idle instance
        teaches its speed, and only if it ends first (the same length: one queued behind it may not)."""
        st = self._prefill.setdefault(b.id, _PrefillState())
        st.outstanding = max(0, st.outstanding - 1)
        st.outstanding_tokens = max(0, st.outstanding_tokens - tokens) if st.outstanding else 0
        st.since = self.clock()  # the next one runs from now
        if seconds is not None and tokens > 0 and st.solo_tokens == tokens:
            st.fit.add(tokens, seconds)
        st.solo_tokens = None

    # -- decode --------------------------------------------------------------------------------
    def set_capacity(self, b: Backend, tokens: int) -> None:
        self._decode.setdefault(b.id, _DecodeState()).capacity_tokens = tokens

    def decode_slots(self, b: Backend) -> int | None:
        """b's batch slots: configured, else launched, raised by what its /metrics showed."""
        base = self.slots if self.slots is not None else b.slots
        st = self._decode.get(b.id)
        learnt = st.learnt_slots if st is not None else None
        return base if learnt is None else max(base or 0, learnt)

    def observe_signals(self, b: Backend, signals: Signals, changed: bool) -> None:
        """A /metrics poll of decode instance b."""
        if changed:
            st = self._decode.setdefault(b.id, _DecodeState())
            st.learnt_slots = learn_slots(self.decode_slots(b), signals)

    def decode_score(self, b: Backend, tokens: int) -> tuple[int, float]:
        st = self._decode.get(b.id) or _DecodeState()
        if st.capacity_tokens:
            fill = (st.reserved_tokens + tokens) / st.capacity_tokens
            return (1 if fill > 1 else 0, (st.running + 1) / max(0.05, 1 - min(fill, 0.95)))
        return 0, float(st.running + 1)

    def pick_decode(self, candidates: list[Backend], tokens: int) -> Backend:
        """KV room first, then a batch slot (free, else the soonest predicted to free: a full
        instance queues the decode in its engine), then the lightest load."""
        def key(b: Backend) -> tuple[int, float, float, int]:
            over, score = self.decode_score(b, tokens)
            return over, self.decode_slot_in((b,), 0), score, b.in_flight

        return min(candidates, key=key)

    def decode_started(self, b: Backend, tokens: int, out_tokens: int = 0) -> DecodeRun:
        """b takes one decode (its slot and ``tokens`` of KV) until ``decode_done``."""
        st = self._decode.setdefault(b.id, _DecodeState())
        st.running += 1
        st.reserved_tokens += tokens
        run = DecodeRun(self.clock(), out_tokens)
        st.runs.append(run)
        return run

    def decode_done(self, b: Backend, tokens: int, run: DecodeRun | None = None, ok: bool = False) -> None:
        """ok: the decode ran to its end, so its time teaches the instance's speed."""
        st = self._decode.setdefault(b.id, _DecodeState())
        st.running = max(0, st.running - 1)
        st.reserved_tokens = max(0, st.reserved_tokens - tokens)
        if run is None:
            return
        if run in st.runs:
            st.runs.remove(run)
        if ok and run.out_tokens > 0:
            # From its first token: time spent waiting for a slot in the engine is not speed.
            spt = (self.clock() - (run.first_at if run.first_at is not None else run.started)) / run.out_tokens
            st.seconds_per_token = spt if st.seconds_per_token is None else st.seconds_per_token + EWMA * (spt - st.seconds_per_token)

    def forget(self, backend_id: str) -> None:
        self._prefill.pop(backend_id, None)
        self._decode.pop(backend_id, None)
