"""The gateway queue: late binding, priority classes, fair shares and load shedding, per model.

A request is bound to a backend the moment one can start it soon. When every eligible backend
would make it wait longer than ``HOLD_WAIT`` for a batch slot or KV room (the policy's
prediction), it waits here instead of in a backend's queue, and is bound when a backend frees
capacity: a response finishing, a /metrics poll, a backend coming back. Whoever frees capacity
calls ``wake(model)``.

Order: the highest priority class first; within a class, keys take turns by deficit round robin
(each round a key may send ``QUANTUM`` tokens' worth of requests), so one key's burst cannot
starve the others; a key's own requests keep their order.

Shedding: each class has a maximum wait. A request that is predicted not to start in time is
refused at once (503, or 429 when its key holds more than its fair share of the class's queue),
with ``Retry-After``; one still waiting at its deadline is refused then. When the queue is full, the
newest request of the lowest class below the newcomer's makes room; otherwise the newcomer is
refused.

``Admission`` is the logic, without I/O or timers (the offline bench drives it in virtual time);
``GatewayQueue`` adds the futures and deadline timers the router awaits. Capacity comes from
``room``, by default the policy's predictions. With several gateway replicas on one Redis, a
backend's load counts the others' in-flight requests (``Backend.remote_in_flight``, exchanged every
``state.load_interval``) as well as its /metrics: its free slots are slots - ours - theirs, and
a backend is idle only when neither has a request on it. The exchange is that stale, so two
replicas may both bind to the last free slot within one interval; nothing else oversubscribes.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

from .. import metrics
from ..config.balancer import DEFAULT_PRIORITY, QueueConfig, priority_name
from ..errors import Refusal
from .policies import Balancer, Outcome, Prediction, RequestInfo
from .pool import Backend

# (eligible backends, the request, its priority class) -> the backends that can start it now.
Room = Callable[[Sequence[Backend], RequestInfo, int], Sequence[Backend]]


class Binder(Protocol):
    """Who binds a request to one of the backends with room: a balancing policy, or the
    prefill/decode picker for its prefill phase (``pd_policy.PDPicker``). ``completed`` is called
    here only for a request bound just before its client left."""

    def pick(self, candidates: Sequence[Backend], req: Any) -> Backend: ...
    def dispatched(self, backend: Backend, req: Any) -> None: ...
    def completed(self, backend: Backend, req: Any, outcome: Outcome) -> None: ...

# A request is refused on arrival when its predicted wait exceeds this share of its class's limit:
# at the limit itself, half of those admitted would still time out in the queue (slowly).
SHED_MARGIN = 0.6
# Seconds with nothing waiting after which the next busy spell measures the rate afresh.
QUIET_RESET = 1.0
# Since a busy spell began, the rate counts once its responses span this share of the spell (up to
# the rate's window): responses of one batch that end together are one sample.
SPREAD = 0.25
# The predicted wait is corrected by how long waits came out against their predictions (ClassQueue.
# wait_ratio): each bind or deadline moves the ratio this share of the way, within these bounds.
WAIT_RATIO_RATE = 0.05
WAIT_RATIO_MIN = 0.5
WAIT_RATIO_MAX = 4.0
# Seconds of prefill a request below the interactive class may find queued on a backend it is bound to.
LOW_PREFILL_AHEAD = 0.05
# How long after the last interactive request lower classes keep leaving ``RESERVE`` free.
RESERVE_FOR = 30.0
# The interactive binds per model whose backends give each backend's share (``KEEP_SHARE``), and
# how many must be seen before a share counts.
SHARE_WINDOW = 64
SHARE_MIN = 16
# Were balancer.queue settings until issue 33; each keeps the default the bench chose. ``Admission``
# copies them at construction (``hold_wait``, ``reserve``, ... on the instance: a test may set them).
# 79e3ffd, 2026-12-02 (bench/routing "Tail latency: ... the gateway queue", never swept): with 0.5 s the queue held
# nothing at 80 % load and below on sockets, and held a batch flood back for interactive TTFT p99 +2 % beside it.
HOLD_WAIT = 0.5  # seconds: when every backend would make a request wait longer than this for a slot or KV room, it waits here
# 79e3ffd, 2026-12-02; never swept by a bench: about 4 requests of the routing bench's mean size (217 + 40 tokens) per turn.
QUANTUM = 1024  # tokens a key may send per round within its class (deficit round robin)
# a4fc338, 2026-12-02; mixed replay 2026-12-03: 0.85 gave +3 % / +9 % interactive TTFT p99 at 30 / 120 s but 40 % fewer batch completions.
RESERVE = 0.75  # share of a backend's batch slots that classes below interactive leave free while interactive requests come
# Mixed replay with learnt slots, 2026-12-03 (6817f16): 0.75 let the flood hold twice what the slots' reserve allows
# (+25/+21/+20/+6 % interactive TTFT p99), 0.85 +1/+4/+3/-1 %, 0.9 cost 40 % of the batch completions.
KV_RESERVE = 0.85  # the same for a backend's KV cache while its slots are unknown (a held-back flood never fills a batch)
# Mixed replay, 2026-12-03 (8ef7cf1): learnt slots, 120 s, interactive TTFT p99 beside the flood +103 % -> +5 %;
# 2 can never apply with 2 backends.
KEEP_SHARE = 1.5  # lower classes keep off a backend that took more than this times an even share of the recent interactive binds; 0: off


@dataclass(slots=True, eq=False)
class Waiter:
    req: RequestInfo
    key: str  # the API key's name ("" without authentication)
    priority: int
    cost: float  # tokens, for the round robin
    enqueued_at: float
    deadline: float
    predicted: float = 0.0  # the wait predicted at arrival from the completion rate (0: none was)
    backend: Backend | None = None  # set when bound
    refusal: Refusal | None = None  # set when shed
    future: asyncio.Future | None = field(default=None, repr=False)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.backend is not None or self.refusal is not None


class ClassQueue:
    """One priority class: a FIFO per key, served by deficit round robin."""

    __slots__ = ("quantum", "keys", "deficit", "size", "turn", "wait_ratio")

    def __init__(self, quantum: float):
        self.quantum = quantum
        self.keys: OrderedDict[str, deque[Waiter]] = OrderedDict()  # active keys in turn order
        self.deficit: dict[str, float] = {}
        self.size = 0
        self.turn: str | None = None  # the key whose turn it is (its quantum for this round is added)
        # Waits as they came out against what the completion rate predicted at arrival (a moving mean
        # of actual/predicted), per class: the rate counts every response that ends, also those of
        # requests bound earlier and waiting in a backend's own queue, which free no room for the
        # queue's (in overload with unknown slots the waits ran ~2x the prediction and a fifth of the
        # refusals came at the deadline, not at once: replay, 150 %); and a lower class also waits
        # behind the rules that keep room for higher ones.
        self.wait_ratio = 1.0

    def push(self, w: Waiter) -> None:
        q = self.keys.get(w.key)
        if q is None:
            q = self.keys[w.key] = deque()
            self.deficit[w.key] = 0.0
        q.append(w)
        self.size += 1

    def pop(self) -> Waiter:
        """The next request by deficit round robin (the class must not be empty)."""
        # A key's turn adds one quantum; it sends while its deficit covers its next request, then
        # the turn passes. Bounded: a head of cost c goes within ceil(c / quantum) rounds.
        while True:
            key, q = next(iter(self.keys.items()))
            if self.turn != key:
                self.turn = key
                self.deficit[key] += self.quantum
            head = q[0]
            if self.deficit[key] >= head.cost:
                self.deficit[key] -= head.cost
                q.popleft()
                self.size -= 1
                if not q:  # an idle key keeps no credit
                    del self.keys[key], self.deficit[key]
                    self.turn = None
                return head
            self.turn = None
            self.keys.move_to_end(key)

    def unpop(self, w: Waiter) -> None:
        """Undo ``pop``: w is first again, in its key's turn, its cost back in the deficit."""
        q = self.keys.get(w.key)
        if q is None:
            q = self.keys[w.key] = deque()
            self.deficit[w.key] = 0.0
        q.appendleft(w)
        self.keys.move_to_end(w.key, last=False)
        self.deficit[w.key] += w.cost
        self.turn = w.key
        self.size += 1

    def remove(self, w: Waiter) -> bool:
        q = self.keys.get(w.key)
        if q is None:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        self.size -= 1
        if not q:
            del self.keys[w.key], self.deficit[w.key]
            if self.turn == w.key:
                self.turn = None
        return True

    def ahead_of(self, key: str) -> int:
        """Requests served before a new one from ``key`` with equal costs: one turn per active key per request."""
        mine = len(self.keys.get(key, ())) + 1
        return sum(min(len(q), mine) for k, q in self.keys.items() if k != key) + mine - 1

    def over_share(self, key: str) -> bool:
        """The key holds more than an equal share of this class's queue."""
        q = self.keys.get(key)
        return q is not None and len(q) > 1 and len(q) * len(self.keys) > self.size

    def newest(self) -> Waiter | None:
        """The newest request of the key holding the most (who gives way when the queue is full)."""
        if not self.keys:
            return None
        return max(self.keys.values(), key=len)[-1]


class ModelQueue:
    """The waiting requests of one model, by class (highest first)."""

    def __init__(self, quantum: float):
        self.quantum = quantum
        self.classes: dict[int, ClassQueue] = {}
        self.completions: deque[float] = deque(maxlen=256)  # when recent responses of this model finished
        # The busy spell that followed a quiet one began at ``origin``; the rate forgets what came
        # before it. A quiet spell's responses end as fast as requests come, not as fast as the
        # backends serve them: its rate once predicted 17-s waits for a burst that a real api_server
        # served within 1.6 s, and 61 of 96 requests were refused (deploy/gpu_smoke.py on an H200).
        # A queue that empties for a moment under load keeps its rate.
        self.origin: float | None = None  # None: from the first response kept
        self.idle_since: float | None = -math.inf  # since when nothing has waited here (None: requests wait)

    def __len__(self) -> int:
        return sum(c.size for c in self.classes.values())

    def by_priority(self) -> Iterator[tuple[int, ClassQueue]]:
        return ((p, self.classes[p]) for p in sorted(self.classes, reverse=True) if self.classes[p].size)

    def cls(self, priority: int) -> ClassQueue:
        c = self.classes.get(priority)
        if c is None:
            c = self.classes[priority] = ClassQueue(self.quantum)
        return c

    def waiting_at_or_above(self, priority: int) -> int:
        return sum(c.size for p, c in self.classes.items() if p >= priority)

    def waits_from(self, now: float) -> None:
        """A request is about to wait here: a busy spell after a quiet one (nothing waiting for more than
        ``QUIET_RESET``) measures the rate afresh."""
        if self.idle_since is not None:
            if now - self.idle_since > QUIET_RESET:
                self.completions.clear()
                self.origin = now
            self.idle_since = None

    def note_busy(self, now: float) -> None:
        """Call after waiters left: the queue's quiet spell starts when the last one goes."""
        if not len(self) and self.idle_since is None:
            self.idle_since = now

    def completed(self, now: float) -> None:
        self.completions.append(now)

    def rate(self, now: float, window: float = 30.0) -> float:
        """Responses finished per second lately; 0 while there are too few to tell, or while they are
        bunched: since a busy spell began (``origin``), they must span ``SPREAD`` of its time."""
        t = self.completions
        while t and now - t[0] > window:
            t.popleft()
        if len(t) < 8 or now <= t[0]:
            return 0.0
        since = max(t[0] if self.origin is None else self.origin, now - window)
        if t[-1] - t[0] < SPREAD * (now - since):
            # One batch's responses ending together are one sample, not a flow: a cold engine's first
            # batch of 8 took 3 s, and 24 waiters extrapolated at that rate were refused; the next
            # batches took 0.6 s each and the queue emptied in 1.5 s (deploy/gpu_smoke.py on an H200).
            # Until the responses spread out, the deadline alone refuses.
            return 0.0
        return len(t) / (now - t[0])


class Admission:
    """The queue's decisions, without I/O: bind now, wait, or refuse."""

    def __init__(self, config: QueueConfig, balancer: Balancer | Binder, eligible: Callable[[str], list[Backend]], clock: Callable[[], float], room: Room | None = None,
                 keep_share: float = KEEP_SHARE):
        """balancer binds; without ``room`` it must be a ``Balancer`` that predicts. ``keep_share``: the
        disaggregated models' queue has its own (``disagg.PD_KEEP_SHARE``)."""
        self.config = config
        self.hold_wait = HOLD_WAIT
        self.quantum = QUANTUM
        self.reserve = RESERVE
        self.kv_reserve = KV_RESERVE
        self.keep_share = keep_share
        self.balancer = balancer
        self.eligible = eligible
        self.clock = clock
        self.room = room or self.predicted_room
        self.models: dict[str, ModelQueue] = {}
        self.displaced: list[Waiter] = []  # refused by ``admit`` to make room: their waiters must be told
        self.top_seen: dict[str, float] = {}  # by model: when an interactive (or higher) request last arrived
        self.top_binds: dict[str, deque[str]] = {}  # by model: the backends of the last SHARE_WINDOW interactive binds

    # -- capacity --------------------------------------------------------------------------------
    def predicted_room(self, candidates: Sequence[Backend], req: RequestInfo, priority: int) -> Sequence[Backend]:
        """The backends that can start req within ``HOLD_WAIT``, by the policy's predictions. Below
        the interactive class, while interactive requests come, a request must also leave
        ``RESERVE`` of a backend's batch slots (or ``KV_RESERVE`` of its KV cache) free and find no prefill queued: interactive requests
        then find a slot, short steps and an empty prefill queue."""
        if not candidates:
            return ()
        hold = self.hold_wait
        if self.reserving(req.model, priority):
            # While interactive requests come, it must not slow their steps nor queue its prefill
            # in front of theirs (the backends kept for them are left out already: ``fit``).
            preds = self.balancer.predict(candidates, req)
            fit = [b for b, p in zip(candidates, preds)
                   if p.wait <= hold and p.prefill_ahead <= LOW_PREFILL_AHEAD and self._leaves_reserve(p)]
            return fit
        # The policy chooses among all of them (it weighs the wait against speed and cache). An
        # idle backend always takes work: the queue never waits on a prediction alone. Idle counts
        # the other replicas' requests too (the shared state): one that looks idle here but is full
        # through them must not take a request that would queue in its engine. A backend the policy
        # knows to have a free slot and KV room needs no prediction either (its wait is 0): the
        # estimate, which walks every request in flight, is made only when it decides.
        if any(b.in_flight + b.remote_in_flight == 0 for b in candidates) or any(self.balancer.starts_at_once(b, req) for b in candidates):
            return candidates
        if any(p.wait <= hold for p in self.balancer.predict(candidates, req)):
            return candidates
        return ()

    def _leaves_reserve(self, p: Prediction) -> bool:
        """Binding leaves ``RESERVE`` of the backend's batch slots free or, while they are unknown,
        ``KV_RESERVE`` of its KV cache (when its capacity is known). The slots are learnt only from a
        full batch, and the queue holds a flood back (KV room, ``HOLD_WAIT``) before it fills one:
        without this, a flood ran 25-29 sequences on backends with 32 slots beside the interactive
        requests, each slowing their steps and stalling them with its prefill (bench/routing/README.md of 227c192,
        "Mixed priority with learnt slots")."""
        if p.slots is not None:
            return p.free >= 1 + int(self.reserve * p.slots)
        return p.kv_free is None or p.kv_free >= self.kv_reserve

    def reserving(self, model: str, priority: int) -> bool:
        """A request of this class must leave ``RESERVE`` free: it is below interactive and
        interactive requests for the model came lately."""
        return priority < DEFAULT_PRIORITY and self.clock() - self.top_seen.get(model, -1e18) < RESERVE_FOR

    def fit(self, candidates: Sequence[Backend], req: RequestInfo, priority: int) -> Sequence[Backend]:
        """``room`` among the candidates req's class may take: below interactive, while interactive
        requests come, not the backends kept for them. Here, not in ``room``, so that every ``room``
        (the policy's predictions, the prefill/decode picker's) keeps them."""
        if candidates and self.reserving(req.model, priority):
            candidates = self.unkept(req.model, candidates)
        return self.room(candidates, req, priority)

    def unkept(self, model: str, candidates: Sequence[Backend]) -> Sequence[Backend]:
        """The candidates less those ``kept`` (never all of them)."""
        kept = self.kept(model, candidates)
        return [b for b in candidates if b.id not in kept] if kept else candidates

    def top_bound(self, model: str, backend: Backend) -> None:
        """An interactive (or higher) request of the model was bound to backend: its share counts
        for ``kept``. ``_bind`` records the binder's choice; a disaggregated request's decode
        instance, picked after its prefill, is recorded by the dispatcher."""
        binds = self.top_binds.get(model)
        if binds is None:
            binds = self.top_binds[model] = deque(maxlen=SHARE_WINDOW)
        binds.append(backend.id)

    def kept(self, model: str, candidates: Sequence[Backend]) -> set[str]:
        """The backends kept for interactive requests: each took more than ``keep_share`` (``KEEP_SHARE``) times an
        even share (1/N of the candidates) of the model's recent interactive binds to the
        candidates (binds elsewhere, such as a disaggregated request's other phase, do not count). The policy sends
        most interactive requests to the backend that starts them soonest (on a mixed fleet, the
        fastest); there every batch sequence slows the steps of most interactive requests and every
        batch prefill stalls them, while on a backend they rarely use the same work delays few.
        Never every candidate: one that only shares the traffic evenly is not kept."""
        k = self.keep_share
        binds = self.top_binds.get(model)
        if not k or binds is None or len(binds) < SHARE_MIN or len(candidates) < 2:
            return set()
        counts: dict[str, int] = {}
        for bid in binds:
            counts[bid] = counts.get(bid, 0) + 1
        seen = sum(counts.get(b.id, 0) for b in candidates)
        if seen < SHARE_MIN:
            return set()
        limit = k * seen / len(candidates)
        kept = {b.id for b in candidates if counts.get(b.id, 0) > limit}
        return kept if len(kept) < len(candidates) else set()

    def _bind(self, candidates: Sequence[Backend], req: RequestInfo, priority: int) -> Backend:
        b = self.balancer.pick(candidates, req)
        self.balancer.dispatched(b, req)
        if priority >= DEFAULT_PRIORITY:
            self.top_bound(req.model, b)
        return b

    def _queue(self, model: str) -> ModelQueue:
        q = self.models.get(model)
        if q is None:
            q = self.models[model] = ModelQueue(self.quantum)
        return q

    # -- arrivals --------------------------------------------------------------------------------
    def admit(self, req: RequestInfo, key: str, priority: int) -> Backend | Waiter | Refusal:
        """Bind req to a backend now, or queue it (a ``Waiter``), or refuse it."""
        now = self.clock()
        q = self._queue(req.model)
        req.priority = priority
        if priority >= DEFAULT_PRIORITY:
            self.top_seen[req.model] = now
        candidates = self.eligible(req.model)
        if not q.waiting_at_or_above(priority):
            fit = self.fit(candidates, req, priority)
            if fit:
                return self._bind(fit, req, priority)
        limit = self.config.wait_limit(priority)
        cls = q.cls(priority)
        q.waits_from(now)
        rate = q.rate(now)
        predicted = 0.0
        if rate > 0:
            ahead = sum(c.size for p, c in q.classes.items() if p > priority) + cls.ahead_of(key)
            predicted = (ahead + 1) / rate
            expected = predicted * cls.wait_ratio
            if expected > SHED_MARGIN * limit:
                return self._shed_refusal(req.model, q, cls, key, priority, expected, "predicted")
        if len(q) >= self.config.max_queued:
            victim = self._lowest_below(q, priority)
            if victim is None:
                return self._shed_refusal(req.model, q, cls, key, priority, limit, "queue_full")
            vcls = q.classes[victim.priority]
            victim.refusal = self._shed_refusal(req.model, q, vcls, victim.key, victim.priority, limit, "displaced")
            vcls.remove(victim)
            self.displaced.append(victim)
        w = Waiter(req, key, priority, cost=self._cost(req), enqueued_at=now, deadline=now + limit, predicted=predicted)
        cls.push(w)
        return w

    def _cost(self, req: RequestInfo) -> float:
        return max(1.0, req.prompt_tokens + (req.max_tokens or 0))

    @staticmethod
    def _lowest_below(q: ModelQueue, priority: int) -> Waiter | None:
        for p in sorted(q.classes):
            if p >= priority:
                return None
            w = q.classes[p].newest()
            if w is not None:
                return w
        return None

    def _shed_refusal(self, model: str, q: ModelQueue, cls: ClassQueue, key: str, priority: int, wait: float, why: str) -> Refusal:
        q.note_busy(self.clock())  # refused on arrival at an empty queue: it stays quiet
        rate = q.rate(self.clock())
        # The predicted time until this queue has room: Retry-After in whole seconds, and
        # retry-after-ms (which the openai SDK reads first) with the same prediction unrounded.
        ms = max(1, math.ceil(min(60.0, len(q) / rate if rate > 0 else wait) * 1000))
        retry = max(1, math.ceil(ms / 1000))
        metrics.QUEUE_SHED.labels(priority=priority_name(priority), reason=why, model=model).inc()
        headers = ((b"retry-after", str(retry).encode()), (b"retry-after-ms", str(ms).encode()))
        if cls.over_share(key):
            return Refusal(
                429,
                f"This API key has more than its share of requests waiting for this model; retry in {retry} s.",
                "queue_over_share",
                code="rate_limit_exceeded",
                headers=headers,
            )
        return Refusal(
            503,
            f"Every backend for this model is busy and the request could not start in time; retry in {retry} s.",
            "queue_shed",
            code="service_unavailable",
            headers=headers,
        )

    # -- capacity freed ------------------------------------------------------------------------------
    def completed(self, model: str) -> None:
        self._queue(model).completed(self.clock())

    def drain(self, model: str) -> list[Waiter]:
        """Bind waiting requests, best class first, while some backend has room; returns those bound."""
        q = self.models.get(model)
        bound: list[Waiter] = []
        if q is None or not len(q):
            return bound
        candidates = self.eligible(model)
        for _ in range(len(q)):
            cls = next(c for _, c in q.by_priority())
            w = cls.pop()
            fit = self.fit(candidates, w.req, w.priority)
            if not fit:
                cls.unpop(w)
                break
            w.backend = self._bind(fit, w.req, w.priority)
            waited = self.clock() - w.enqueued_at
            self._learn_wait(cls, w, waited)
            metrics.QUEUE_WAIT.labels(priority=priority_name(w.priority)).observe(waited)
            bound.append(w)
        q.note_busy(self.clock())
        return bound

    def expire(self, w: Waiter) -> bool:
        """w reached its deadline still waiting: refuse it. False when it was bound or gone already."""
        if w.done:
            return False
        q = self.models.get(w.req.model)
        if q is None:
            return False
        cls = q.classes.get(w.priority)
        if cls is None or w not in cls.keys.get(w.key, ()):
            return False
        limit = self.config.wait_limit(w.priority)
        self._learn_wait(cls, w, limit)  # at least that long: the ratio learns a lower bound
        w.refusal = self._shed_refusal(w.req.model, q, cls, w.key, w.priority, limit, "deadline")
        cls.remove(w)
        q.note_busy(self.clock())
        return True

    @staticmethod
    def _learn_wait(cls: ClassQueue, w: Waiter, waited: float) -> None:
        """One wait against its prediction: its class's ratio moves WAIT_RATIO_RATE of the way."""
        if w.predicted > 0:
            ratio = min(WAIT_RATIO_MAX, max(WAIT_RATIO_MIN, waited / w.predicted))
            cls.wait_ratio += WAIT_RATIO_RATE * (ratio - cls.wait_ratio)

    def cancel(self, w: Waiter) -> None:
        """The client went away while waiting."""
        q = self.models.get(w.req.model)
        if q is not None and w.priority in q.classes:
            q.classes[w.priority].remove(w)
            q.note_busy(self.clock())

    def waiting(self) -> int:
        return sum(len(q) for q in self.models.values())

    def learnt(self) -> dict[str, Any]:
        """Per model: requests waiting, the rate the queue predicts waits from, and each class's
        ``wait_ratio`` (for operators: ``/admin/balancer``)."""
        now = self.clock()
        return {model: {"waiting": len(q), "rate": q.rate(now), "wait_ratio": {priority_name(p): c.wait_ratio for p, c in q.classes.items()}}
                for model, q in self.models.items()}


class GatewayQueue:
    """``Admission`` for the router: an awaitable admission with a deadline timer per waiter."""

    def __init__(self, admission: Admission):
        self.admission = admission

    async def acquire(self, req: RequestInfo, key: str, priority: int) -> Backend | Refusal:
        """A backend already bound to req (``dispatched`` was called), or the refusal to send."""
        adm = self.admission
        got = adm.admit(req, key, priority)
        while adm.displaced:
            self._settle(adm.displaced.pop())
        if not isinstance(got, Waiter):
            return got
        w = got
        loop = asyncio.get_running_loop()
        w.future = loop.create_future()
        w.timer = loop.call_at(loop.time() + (w.deadline - adm.clock()), self._expire, w)
        metrics.QUEUE_WAITING.inc()
        try:
            return await w.future
        except asyncio.CancelledError:
            if w.backend is not None:  # bound just before the client left: give the reservation back
                adm.balancer.completed(w.backend, req, Outcome(status=0, ok=False))
                self.wake(req.model)
            else:
                adm.cancel(w)
            raise
        finally:
            metrics.QUEUE_WAITING.dec()
            w.timer.cancel()

    def _expire(self, w: Waiter) -> None:
        if self.admission.expire(w):
            self._settle(w)

    def _settle(self, w: Waiter) -> None:
        fut = w.future
        if fut is not None and not fut.done():
            fut.set_result(w.backend if w.backend is not None else w.refusal)

    def completed(self, model: str) -> None:
        """A response of this model finished: its backend has room for one more."""
        self.admission.completed(model)
        self.wake(model)

    def wake(self, model: str | None = None) -> None:
        """Capacity may have freed (a response finished, a /metrics poll, a backend back): bind who can start."""
        models = [model] if model is not None else list(self.admission.models)
        for m in models:
            for w in self.admission.drain(m):
                self._settle(w)
