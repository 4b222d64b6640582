"""The gateway queue's decisions (late binding, priority order, DRR fairness, shedding) and the
TTFT/e2e predictor: in-process, deterministic (fake clock, seeded rng)."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.config import ConfigError, parse_config
from gateway.config.balancer import PRIORITY_NAMES, BalancerConfig, QueueConfig
from gateway.routing.policies import ExpectedLatencyBalancer, Outcome, RequestInfo, make_balancer
from gateway.routing.pool import Backend
from gateway.routing.queue import Admission, ClassQueue, GatewayQueue, Waiter

pytestmark = pytest.mark.unit

INTERACTIVE = PRIORITY_NAMES["interactive"]
BATCH = PRIORITY_NAMES["batch"]


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def backends(*ids: str) -> list[Backend]:
    return [Backend(id=i, url=f"http://{i}.invalid", models=frozenset({"m"}), healthy=True) for i in ids]


def req(prompt: int = 10, out: int = 10) -> RequestInfo:
    return RequestInfo(model="m", stream=True, prompt_tokens=prompt, max_tokens=out)


def waiter(key: str, cost: float = 1.0, priority: int = INTERACTIVE) -> Waiter:
    return Waiter(req(), key, priority, cost=cost, enqueued_at=0.0, deadline=10.0)


class Gate:
    """A ``room`` callable the test opens and closes."""

    def __init__(self, open_: bool = False):
        self.open = open_

    def __call__(self, candidates, r, priority):
        return list(candidates) if self.open else []


def policy(clock: Clock, **cfg) -> ExpectedLatencyBalancer:
    """min_expected_latency as configured, with no slow start (``SLOW_START``, a constant: set on this instance)."""
    b = make_balancer("min_expected_latency", BalancerConfig(**cfg), clock=clock, rng=random.Random(0))
    assert isinstance(b, ExpectedLatencyBalancer)
    b.SLOW_START = 0.0
    return b


def with_constants(adm: Admission, **constants: float) -> Admission:
    """The queue's constants that were balancer.queue settings until issue 33 (``queue.HOLD_WAIT``,
    ``RESERVE``, ``KV_RESERVE``, ``KEEP_SHARE``): Admission copies them, a test sets its own instance's."""
    for k, v in constants.items():
        assert hasattr(adm, k), k
        setattr(adm, k, v)
    return adm


def admission(clock: Clock, gate: Gate, members: list[Backend] | None = None, **queue) -> Admission:
    members = backends("a") if members is None else members
    return Admission(QueueConfig(**queue), policy(clock), lambda model: members, clock, room=gate)


# -- deficit round robin within a class ------------------------------------------------------------

def test_drr_takes_keys_in_turn_so_a_burst_does_not_starve_the_others():
    cq = ClassQueue(quantum=1)
    for i in range(6):
        cq.push(waiter("burst"))
    cq.push(waiter("quiet"))
    cq.push(waiter("quiet"))
    order = [cq.pop().key for _ in range(8)]
    assert order[:4] == ["burst", "quiet", "burst", "quiet"]
    assert order[4:] == ["burst"] * 4
    assert cq.size == 0 and not cq.keys


def test_drr_shares_tokens_not_requests():
    cq = ClassQueue(quantum=1000)
    for _ in range(3):
        cq.push(waiter("big", cost=2000))
    for _ in range(8):
        cq.push(waiter("small", cost=250))
    first = [cq.pop().key for _ in range(5)]
    # "big" needs two rounds of quantum for one request; "small" sends four per round meanwhile.
    assert first.count("small") == 4 and first.count("big") == 1


def test_unpop_puts_the_request_back_first_with_its_deficit():
    cq = ClassQueue(quantum=1)
    a1, a2, b1 = waiter("a"), waiter("a"), waiter("b")
    for w in (a1, a2, b1):
        cq.push(w)
    w = cq.pop()
    assert w is a1
    cq.unpop(w)
    assert [cq.pop() for _ in range(3)] == [a1, b1, a2]


def test_over_share_means_more_than_an_equal_part_of_the_class():
    cq = ClassQueue(quantum=1)
    for _ in range(5):
        cq.push(waiter("hog"))
    cq.push(waiter("fair"))
    assert cq.over_share("hog") and not cq.over_share("fair")
    assert cq.ahead_of("fair") == 3  # hog, fair, hog, then a new one of fair


# -- admission: bind now, wait, priority order -----------------------------------------------------

def test_a_request_binds_at_once_while_a_backend_has_room_and_waits_when_none_has():
    clock, gate = Clock(), Gate(open_=True)
    adm = admission(clock, gate)
    got = adm.admit(req(), "k", INTERACTIVE)
    assert isinstance(got, Backend) and got.in_flight == 1  # picked and dispatched
    gate.open = False
    w = adm.admit(req(), "k", INTERACTIVE)
    assert isinstance(w, Waiter) and adm.waiting() == 1 and adm.drain("m") == []
    gate.open = True
    assert adm.drain("m") == [w] and w.backend is not None and adm.waiting() == 0


def test_higher_classes_are_served_first_and_a_newcomer_does_not_jump_its_own_class():
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate)
    batch = [adm.admit(req(), "bulk", BATCH) for _ in range(3)]
    ui = adm.admit(req(), "ui", INTERACTIVE)
    gate.open = True
    assert adm.drain("m") == [ui, *batch]
    # With a request of its class waiting, a newcomer queues behind it even when there is room.
    gate.open = False
    first = adm.admit(req(), "ui", INTERACTIVE)
    gate.open = True
    second = adm.admit(req(), "ui2", INTERACTIVE)
    assert isinstance(first, Waiter) and isinstance(second, Waiter)
    assert adm.drain("m") == [first, second]


def test_no_eligible_backend_means_waiting_not_binding():
    clock = Clock()
    adm = admission(clock, Gate(open_=True), members=[])
    assert isinstance(adm.admit(req(), "k", INTERACTIVE), Waiter)


# -- shedding ----------------------------------------------------------------------------------------

def test_a_request_still_waiting_at_its_deadline_is_refused_with_503_and_retry_after():
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate, max_wait=((INTERACTIVE, 2.0),))
    w = adm.admit(req(), "k", INTERACTIVE)
    assert w.deadline == clock.t + 2.0
    clock.t += 2.0
    assert adm.expire(w) is True
    r = w.refusal
    assert r.status == 503 and r.reason == "queue_shed"
    assert dict(r.headers)[b"retry-after"].isdigit()
    assert b'"type":"server_error"' in r.body() and b'"code":"service_unavailable"' in r.body()
    assert adm.waiting() == 0
    assert adm.expire(w) is False  # once only


def test_a_bound_request_does_not_expire():
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate)
    w = adm.admit(req(), "k", INTERACTIVE)
    gate.open = True
    adm.drain("m")
    assert adm.expire(w) is False and w.refusal is None


def test_a_key_over_its_share_is_refused_with_429():
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate)
    hog = [adm.admit(req(), "hog", BATCH) for _ in range(4)]
    adm.admit(req(), "other", BATCH)
    clock.t += 60.0
    assert adm.expire(hog[0]) and hog[0].refusal.status == 429 and hog[0].refusal.reason == "queue_over_share"
    assert b"rate_limit_error" in hog[0].refusal.body()


def test_a_request_predicted_to_miss_its_deadline_is_refused_on_arrival():
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate, max_wait=((INTERACTIVE, 1.0),))
    held = adm.admit(req(), "k0", INTERACTIVE)  # from here on requests wait: the responses that end tell the rate
    for _ in range(20):  # 20 responses over 10 s of waiting: 2 per second
        clock.t += 0.5
        adm.completed("m")
    gate.open = True
    assert adm.drain("m") == [held]  # nothing waits for a moment: the rate is kept
    gate.open = False
    clock.t += 0.5
    first = adm.admit(req(), "k1", INTERACTIVE)
    assert isinstance(first, Waiter)  # expected to start in 1 / 2.1 s: within the margin of its 1 s limit
    late = adm.admit(req(), "k2", INTERACTIVE)  # one ahead of it: about 0.95 s, past the margin
    assert not isinstance(late, Waiter)
    assert late.status == 503 and late.reason == "queue_shed" and dict(late.headers)[b"retry-after"] == b"1"
    assert adm.waiting() == 1


def test_a_refusal_says_when_to_retry_in_seconds_and_milliseconds_and_is_counted_by_model():
    """Retry-After (whole seconds, at least 1) and retry-after-ms (which the openai SDK reads first)
    carry the same prediction: the waiting requests over the rate responses end at (here 1 / 2 s)."""
    from gateway.metrics import QUEUE_SHED

    clock, gate = Clock(), Gate()
    adm = admission(clock, gate, max_wait=((INTERACTIVE, 1.0),))
    held = adm.admit(req(), "k0", INTERACTIVE)
    for _ in range(20):  # 2 responses a second
        clock.t += 0.5
        adm.completed("m")
    gate.open = True
    adm.drain("m")
    gate.open = False
    clock.t += 0.5
    before = QUEUE_SHED.labels(priority="interactive", reason="predicted", model="m")._value.get()
    adm.admit(req(), "k1", INTERACTIVE)
    late = adm.admit(req(), "k2", INTERACTIVE)
    assert not isinstance(late, Waiter)
    h = dict(late.headers)
    ms = int(h[b"retry-after-ms"])
    assert 300 <= ms <= 700  # one waiting at about 2 a second
    assert h[b"retry-after"] == b"1"
    assert QUEUE_SHED.labels(priority="interactive", reason="predicted", model="m")._value.get() == before + 1
    assert held.refusal is None


def test_responses_that_end_while_nothing_waits_do_not_make_the_rate():
    # A quiet spell: responses end as fast as requests come (2 a second), far below what the backends
    # serve. A burst past their slots then waits; it must not be refused on that rate (the old rule
    # predicted ~1 s for the third of them and refused the rest: on a real api_server they started
    # within 1.6 s). Once 8 responses have ended since the burst began, spread out, that rate decides.
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate, max_wait=((INTERACTIVE, 1.0),))
    for _ in range(20):
        clock.t += 0.5
        adm.completed("m")
    burst = [adm.admit(req(), f"k{i}", INTERACTIVE) for i in range(24)]
    assert all(isinstance(w, Waiter) for w in burst) and adm.waiting() == 24
    for _ in range(8):  # 8 responses in 0.35 s while the burst waits: ~23 a second
        clock.t += 0.05
        adm.completed("m")
    late = adm.admit(req(), "k_new", INTERACTIVE)  # 24 ahead: (24 + 1) / 23 s, past the margin of 1 s
    assert not isinstance(late, Waiter) and late.reason == "queue_shed"
    assert adm.waiting() == 24


def test_one_batch_ending_together_is_no_rate():
    # A cold engine's first batch: 8 responses end within 7 ms, 3 s after requests began to wait. Read
    # as a rate that is ~1,100 a second; read over the 3 s, 2.7 a second, which refused 40 of 96
    # requests on an H200 that then served the rest within 1.5 s. One batch is one sample: no rate
    # until the responses span SPREAD of the busy spell, and no refusal on arrival meanwhile.
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate, max_wait=((INTERACTIVE, 1.0),))
    held = [adm.admit(req(), f"k{i}", INTERACTIVE) for i in range(24)]
    clock.t += 3.0
    for _ in range(8):
        clock.t += 0.001
        adm.completed("m")
    q = adm.models["m"]
    assert q.rate(clock.t) == 0.0
    w = adm.admit(req(), "k_new", INTERACTIVE)  # 24 ahead, but no rate to refuse it on: it waits (its deadline bounds it)
    assert isinstance(w, Waiter) and w.predicted == 0.0 and all(isinstance(h, Waiter) for h in held)
    for _ in range(16):  # then a response every 0.25 s: 4 s of the 7 s spell (more than SPREAD)
        clock.t += 0.25
        adm.completed("m")
    assert abs(q.rate(clock.t) - 24 / 4.006) < 0.01
    late = adm.admit(req(), "k_late", INTERACTIVE)  # 25 ahead at 6 a second: past the margin of 1 s
    assert not isinstance(late, Waiter) and late.reason == "queue_shed"


def test_a_quiet_spell_is_forgotten_and_a_moment_without_waiters_is_not():
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate)
    held = adm.admit(req(), "k0", INTERACTIVE)
    for _ in range(20):
        clock.t += 0.1
        adm.completed("m")
    q = adm.models["m"]
    gate.open = True
    assert adm.drain("m") == [held]  # nothing waits now
    gate.open = False
    clock.t += 0.5  # under a second without waiters: the same busy spell
    k1 = adm.admit(req(), "k1", INTERACTIVE)
    assert q.rate(clock.t) > 5
    gate.open = True
    assert adm.drain("m") == [k1]
    gate.open = False
    clock.t += 5.0  # then quiet: the next spell starts afresh
    adm.admit(req(), "k2", INTERACTIVE)
    assert q.rate(clock.t) == 0.0 and not q.completions


def test_the_rate_holds_when_more_responses_end_than_it_keeps():
    # 20 a second for 15 s of waiting: 300 responses, of which the queue keeps the last 256; they are
    # counted over their own span, not over the whole busy spell (that would read 17 a second).
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate)
    adm.admit(req(), "k0", INTERACTIVE)
    for _ in range(300):
        clock.t += 0.05
        adm.completed("m")
    assert 19.8 < adm.models["m"].rate(clock.t) < 20.2


def test_waits_longer_than_the_completion_rate_predicts_make_later_arrivals_refused_at_once():
    # Responses end at 2 a second, but the waiters are bound at half that (the others' responses free
    # no room for them): those that timed out teach the queue that its waits run ~2x the prediction,
    # so an arrival that the rate alone would queue (and which would then time out) is refused at once.
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate, max_wait=((INTERACTIVE, 2.0),))
    assert isinstance(adm.admit(req(), "k0", INTERACTIVE), Waiter)
    for i in range(60):  # each waits alone, is predicted ~0.5 s and is bound after 1 s (or expires)
        w = adm.admit(req(), f"w{i}", INTERACTIVE) if i else None
        clock.t += 1.0
        adm.completed("m")
        adm.completed("m")
        gate.open = True
        adm.drain("m")
        gate.open = False
        assert w is None or isinstance(w, Waiter) and w.backend is not None
    assert adm.models["m"].classes[INTERACTIVE].wait_ratio > 1.5
    first = adm.admit(req(), "k1", INTERACTIVE)
    assert isinstance(first, Waiter)
    late = adm.admit(req(), "k2", INTERACTIVE)  # one ahead: predicted ~1 s (under 1.2 s), learnt ~2 s
    assert not isinstance(late, Waiter) and late.status == 503 and late.reason == "queue_shed"


def test_a_full_queue_makes_room_by_shedding_the_lowest_class():
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate, max_queued=2)
    b1 = adm.admit(req(), "bulk", BATCH)
    b2 = adm.admit(req(), "bulk", BATCH)
    ui = adm.admit(req(), "ui", INTERACTIVE)
    assert isinstance(ui, Waiter)
    assert adm.displaced == [b2] and b2.refusal.status in (503, 429) and b1.refusal is None
    adm.displaced.clear()
    refused = adm.admit(req(), "bulk", BATCH)  # full of equal or higher classes: the newcomer is refused
    assert not isinstance(refused, (Waiter, Backend)) and refused.status in (503, 429)


def test_priority_classes_and_waits_are_configured_by_name_or_number():
    cfg = parse_config({
        "auth": {"keys": [{"name": "a", "hash": "sha256:" + "a" * 64, "priority": "batch"}, {"name": "b", "hash": "sha256:" + "b" * 64, "priority": 42}]},
        "backends": [{"url": "http://127.0.0.1:1"}],
        "balancer": {"queue": {"max_wait": {"batch": 100, 42: 7}}},
    })
    assert [k.priority for k in cfg.auth.keys] == [BATCH, 42]
    q = cfg.balancer.queue
    assert q.wait_limit(BATCH) == 100 and q.wait_limit(42) == 7 and q.wait_limit(INTERACTIVE) == 10


@pytest.mark.parametrize(
    "max_wait, priority, wait",
    [
        (None, BATCH, 60.0),  # the defaults: interactive 10, batch 60
        (None, INTERACTIVE, 10.0),
        (None, 5, 60.0),  # not named: the nearest named class below it (batch)
        (None, 50, 10.0),  # above every named class: interactive's
        ({"batch": 100, 42: 7}, 41, 10.0),  # interactive (10) is the nearest below 41
        ({"batch": 100, 42: 7}, 43, 7.0),
        ({"batch": 100, 42: 7}, 100, 7.0),
    ],
)
def test_a_class_max_wait_does_not_name_waits_as_the_nearest_named_class_below_it(max_wait, priority, wait):
    queue = {"max_wait": max_wait} if max_wait else {}
    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1"}], "balancer": {"queue": queue}})
    assert cfg.balancer.queue.wait_limit(priority) == wait


def test_with_no_named_class_below_a_class_takes_the_lowest_named_ones_wait():
    q = QueueConfig(max_wait=((50, 3.0), (INTERACTIVE, 8.0)))
    assert q.wait_limit(BATCH) == 8.0 and q.wait_limit(20) == 8.0 and q.wait_limit(70) == 3.0


@pytest.mark.parametrize(
    "section, message",
    [
        ({"auth": {"keys": [{"name": "a", "hash": "sha256:" + "a" * 64, "priority": "urgent"}]}}, "auth.keys[0].priority: 'urgent' is not a priority class; use batch or interactive"),
        ({"balancer": {"queue": {"max_wait": {"batch": 0}}}}, "balancer.queue.max_wait.batch: 0 is not a wait"),
        ({"balancer": {"queue": {"max_wait": {"vip": 3}}}}, "balancer.queue.max_wait.vip: 'vip' is not a priority class"),
        ({"balancer": {"policy": "round_robin", "queue": {"enabled": True}}}, "balancer.queue.enabled: the gateway queue needs a policy that predicts waits"),
        ({"balancer": {"queue": {"max_qeued": 1}}}, "balancer.queue.max_qeued: unknown field (did you mean 'max_queued'?)"),
        ({"balancer": {"queue": {"max_queued": 0}}}, "balancer.queue.max_queued: 0 is out of range"),
        ({"balancer": {"queue": {"hold_wait": 1}}}, "balancer.queue.hold_wait: this setting was retired; an internal constant now (0.5 s)"),
        ({"balancer": {"queue": {"keep_share": -1}}}, "balancer.queue.keep_share: this setting was retired; "),
    ],
)
def test_bad_queue_config_is_refused_with_a_clear_message(section, message):
    cfg = {"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1"}], **section}
    with pytest.raises(ConfigError) as exc:
        parse_config(cfg)
    assert any(p.startswith(message) for p in exc.value.problems), exc.value.problems


# -- the async wrapper ---------------------------------------------------------------------------------

async def test_acquire_waits_until_capacity_frees_and_a_cancelled_waiter_leaves_the_queue():
    clock, gate = Clock(), Gate()
    adm = admission(clock, gate)
    q = GatewayQueue(adm)
    first = asyncio.create_task(q.acquire(req(), "k", INTERACTIVE))
    gone = asyncio.create_task(q.acquire(req(), "k", INTERACTIVE))
    for _ in range(5):
        await asyncio.sleep(0)
    assert adm.waiting() == 2 and not first.done()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert adm.waiting() == 1
    gate.open = True
    q.completed("m")
    b = await asyncio.wait_for(first, 5)
    assert isinstance(b, Backend) and b.in_flight == 1


async def test_acquire_answers_a_refusal_at_the_deadline():
    adm = Admission(
        QueueConfig(max_wait=((INTERACTIVE, 0.05),)),
        make_balancer("min_expected_latency"),
        lambda model: backends("a"),
        __import__("time").monotonic,
        room=Gate(),
    )
    got = await asyncio.wait_for(GatewayQueue(adm).acquire(req(), "k", INTERACTIVE), 5)
    assert got.status == 503 and adm.waiting() == 0


# -- the predictor -------------------------------------------------------------------------------------

def mel(clock: Clock, **cfg) -> ExpectedLatencyBalancer:
    """The request's own latency only: no slow start, no others' cost, no KV penalty (constants, set on this instance)."""
    b = policy(clock, **cfg)
    b.OTHERS_WEIGHT = 0.0
    b.KV_PENALTY = 0.0
    return b


def set_sigma(bal: ExpectedLatencyBalancer, b: Backend, sigma: float) -> None:
    m = bal._model(b)
    m.w, m.sn, m.sy = 1e6, 0.0, sigma * 1e6


def test_ttft_of_an_idle_backend_is_prefill_plus_one_step():
    clock = Clock()
    bal = mel(clock)
    (a,) = backends("a")
    set_sigma(bal, a, 0.02)
    (p,) = bal.predict([a], req(prompt=400, out=50))
    rho, g = bal.rho, bal.gamma
    assert p.wait == 0.0
    assert p.ttft == pytest.approx(rho * 0.02 * 400 + 0.02 * (1 + g * 0))
    assert p.e2e == pytest.approx(rho * 0.02 * 400 + 0.02 * (1 + g) * 50)


def test_a_full_batch_shows_as_wait_in_the_ttft():
    clock = Clock()
    bal = mel(clock, slots=2)
    (a,) = backends("a")
    set_sigma(bal, a, 0.02)
    for _ in range(2):
        bal.dispatched(a, req(prompt=1, out=300))
    (p,) = bal.predict([a], req(prompt=1, out=10))
    step = 0.02 * (1 + bal.gamma * 2)
    assert p.wait == pytest.approx(300 * step, rel=0.05)  # the first of the two must finish
    assert p.ttft >= p.wait and p.e2e > p.ttft


def test_slots_from_config_seed_the_model_and_others_sequences_take_slots_too():
    clock = Clock()
    bal = mel(clock, slots=4)
    (a,) = backends("a")
    assert bal._model(a).slots == 4
    bal._model(a).ext = 4.0  # four sequences from another replica fill the batch
    (p,) = bal.predict([a], req())
    assert p.wait > 0


def _fast_but_busy_vs_slow_but_free(bal: ExpectedLatencyBalancer) -> tuple[Backend, Backend]:
    fast, slow = backends("fast", "slow")
    set_sigma(bal, fast, 0.01)
    set_sigma(bal, slow, 0.03)
    bal._model(fast).slots = 1
    bal.dispatched(fast, req(prompt=1, out=40))  # the fast one's only slot is busy for 40 steps (~0.4 s)
    return fast, slow


@pytest.mark.parametrize(
    "ttft_weight, expected",
    [
        (0.0, "fast"),  # end-to-end alone: waiting 0.4 s for the fast backend still finishes 100 tokens first
        (ExpectedLatencyBalancer.TTFT_WEIGHT, "slow"),  # the default, 8: starting 0.4 s later costs more than finishing sooner saves
    ],
)
def test_the_ttft_weight_decides_between_starting_sooner_and_finishing_sooner(ttft_weight, expected):
    assert ExpectedLatencyBalancer.TTFT_WEIGHT == 8.0
    bal = mel(Clock())
    bal.TTFT_WEIGHT = ttft_weight
    fast, slow = _fast_but_busy_vs_slow_but_free(bal)
    r = req(prompt=1, out=100)
    pf, ps = bal.predict([fast, slow], r)
    assert pf.ttft > ps.ttft and pf.e2e < ps.e2e  # the case is what it says
    assert bal.pick([fast, slow], r).id == expected


def test_completed_frees_the_slot_the_prediction_waited_for():
    clock = Clock()
    bal = mel(clock, slots=1)
    (a,) = backends("a")
    r1 = req(out=100)
    bal.dispatched(a, r1)
    assert bal.predict([a], req())[0].wait > 0
    bal.completed(a, r1, Outcome(status=200, ok=True, completion_tokens=100))
    assert bal.predict([a], req())[0].wait == 0


def test_lower_classes_leave_reserved_slots_free_while_interactive_requests_come():
    clock = Clock()
    (a,) = backends("a")
    bal = policy(clock, slots=4)
    adm = with_constants(Admission(QueueConfig(), bal, lambda model: [a], clock), reserve=0.5)
    assert isinstance(adm.admit(req(), "bulk", BATCH), Backend)  # no interactive traffic yet: no reserve
    assert isinstance(adm.admit(req(), "ui", INTERACTIVE), Backend)
    held = adm.admit(req(), "bulk", BATCH)  # 2 of 4 slots free: taking one would leave fewer than 2
    assert isinstance(held, Waiter)
    assert isinstance(adm.admit(req(), "ui", INTERACTIVE), Backend)  # interactive may use the reserve
    clock.t += 31.0  # no interactive request for longer than the reserve is kept
    assert adm.drain("m") == [held]


def test_lower_classes_leave_reserved_kv_free_while_the_slots_are_unknown():
    """Slots are learnt only from a full batch, and the queue holds a flood back before it fills one:
    with the slots unknown, ``KV_RESERVE`` of the KV cache is left free (when its capacity is known)."""
    clock = Clock()
    (a,) = backends("a")
    bal = policy(clock)
    adm = with_constants(Admission(QueueConfig(), bal, lambda model: [a], clock), kv_reserve=0.5)
    first = req()
    assert adm.admit(first, "bulk", BATCH) is a
    bal._model(a).kv_capacity = 4 * first.kv_tokens  # room for 4 such requests
    assert bal._model(a).slots is None
    assert adm.admit(req(), "ui", INTERACTIVE) is a
    held = adm.admit(req(), "bulk", BATCH)  # a third would leave a quarter of the KV free, less than half
    assert isinstance(held, Waiter)
    assert adm.admit(req(), "ui", INTERACTIVE) is a  # interactive may use the reserve
    clock.t += 31.0
    assert adm.drain("m") == [held]


def interactive_traffic_on(adm: Admission, bal, members: list[Backend], backend: Backend, n: int) -> None:
    """n interactive requests bound (only ``backend`` eligible meanwhile) and finished at once."""
    saved = list(members)
    members[:] = [backend]
    for _ in range(n):
        r = req()
        assert adm.admit(r, "ui", INTERACTIVE) is backend
        bal.completed(backend, r, Outcome(status=200, ok=True, completion_tokens=10))
    members[:] = saved


@pytest.mark.parametrize("keep_share, kept", [(None, True), (0.0, False)])
def test_lower_classes_keep_off_the_backend_that_takes_most_interactive_requests(keep_share, kept):
    clock = Clock()
    members = backends("fast", "slow")
    fast, slow = members
    bal = policy(clock, slots=32)
    adm = Admission(QueueConfig(), bal, lambda model: members, clock, **({} if keep_share is None else {"keep_share": keep_share}))
    assert keep_share is not None or adm.keep_share == 1.5  # KEEP_SHARE, the default
    with_constants(adm, reserve=0.5)
    interactive_traffic_on(adm, bal, members, fast, 20)  # all of them: more than 1.5 x an even share (50 %)
    got = [adm.admit(req(), "bulk", BATCH) for _ in range(6)]
    assert all(isinstance(b, Backend) for b in got)
    # Kept: every batch request goes to the backend interactive requests rarely use; without the
    # rule the policy spreads them over both (its slots and steps are the interactive requests').
    assert (fast in got) is not kept, [b.id for b in got]
    clock.t += 31.0  # no interactive request lately: every backend takes batch work again
    assert not adm.reserving("m", BATCH) and adm.room(members, req(), BATCH) == members


def test_an_even_share_of_interactive_requests_keeps_no_backend_and_one_backend_is_never_kept():
    clock = Clock()
    members = backends("a", "b")
    a, b = members
    bal = policy(clock, slots=32)
    adm = Admission(QueueConfig(), bal, lambda model: members, clock)  # KEEP_SHARE: 1.5
    interactive_traffic_on(adm, bal, members, a, 10)
    interactive_traffic_on(adm, bal, members, b, 10)
    assert adm.kept("m", members) == set()  # 50 % each: not above 1.5 x 50 %
    interactive_traffic_on(adm, bal, members, a, 40)
    assert adm.kept("m", members) == {"a"}  # 50 of the last 60: 83 % > 75 %
    assert adm.kept("m", [a]) == set()  # the only backend left takes batch work: never all kept
    assert isinstance(adm.admit(req(), "bulk", BATCH), Backend)


def test_other_replicas_in_flight_from_the_shared_state_take_slots_too():
    clock = Clock()
    bal = mel(clock, slots=2)
    (a,) = backends("a")
    assert bal.predict([a], req())[0].wait == 0
    a.remote_in_flight = 2  # two requests through another gateway replica fill the batch
    p = bal.predict([a], req())[0]
    assert p.wait > 0 and p.free == 0


# -- several gateway replicas: the other replicas' in-flight requests (shared state) ----------------


def shared_admission(clock: Clock, members: list[Backend], slots: int, **constants: float) -> Admission:
    bal = mel(clock, slots=slots)
    constants.setdefault("hold_wait", 0.0)  # any wait for a slot holds a request back
    return with_constants(Admission(QueueConfig(), bal, lambda model: members, clock), **constants)


@pytest.mark.parametrize(
    ("local", "remote", "binds"),
    [
        (0, 0, True),  # idle everywhere
        (0, 1, True),  # one of two slots taken through another replica: one free
        (1, 0, True),
        (1, 1, False),  # slots - ours - theirs = 0
        (0, 2, False),  # idle here, full through the others: the idle clause must not admit
        (2, 0, False),
        (0, 5, False),  # more than its slots through the others (their engine queues): still full
    ],
)
def test_free_slots_are_slots_less_ours_less_the_other_replicas(local, remote, binds):
    clock = Clock()
    (a,) = backends("a")
    adm = shared_admission(clock, [a], slots=2)
    for _ in range(local):
        adm.balancer.dispatched(a, req())
    a.remote_in_flight = remote
    got = adm.admit(req(), "k", INTERACTIVE)
    assert isinstance(got, Backend) is binds, got
    assert a.in_flight == local + binds


def test_a_backend_full_through_the_others_is_skipped_for_one_with_room():
    clock = Clock()
    a, b = backends("a", "b")
    adm = shared_admission(clock, [a, b], slots=1)
    a.remote_in_flight = 1
    assert adm.admit(req(), "k", INTERACTIVE) is b
    got = adm.admit(req(), "k", INTERACTIVE)  # a: theirs; b: ours
    assert isinstance(got, Waiter)


def test_a_waiter_binds_when_the_other_replicas_request_finishes():
    clock = Clock()
    (a,) = backends("a")
    adm = shared_admission(clock, [a], slots=1)
    a.remote_in_flight = 1
    w = adm.admit(req(), "k", INTERACTIVE)
    assert isinstance(w, Waiter) and adm.drain("m") == []
    a.remote_in_flight = 0  # the load exchange: their request finished (the cluster then wakes the queue)
    assert adm.drain("m") == [w] and w.backend is a


def test_lower_classes_count_the_other_replicas_in_the_reserve():
    clock = Clock()
    (a,) = backends("a")
    adm = shared_admission(clock, [a], slots=4, reserve=0.5, hold_wait=0.5)
    assert isinstance(adm.admit(req(), "ui", INTERACTIVE), Backend)  # interactive traffic: lower classes keep 2 of 4 free
    a.remote_in_flight = 1  # 1 ours + 1 theirs: 2 free, taking one would leave 1
    assert isinstance(adm.admit(req(), "bulk", BATCH), Waiter)
    a.remote_in_flight = 0
    assert len(adm.drain("m")) == 1



def test_a_backend_the_policy_says_starts_at_once_is_predicted_to_start_with_no_wait():
    # The queue skips the estimate (a walk over every request in flight) when the policy knows a
    # backend has a free slot and KV room: that shortcut must never disagree with the estimate.
    rng = random.Random(7)
    verdicts = set()
    for _ in range(300):
        clock = Clock()
        bal = ExpectedLatencyBalancer(BalancerConfig(), clock=clock, rng=random.Random(1))
        (b,) = backends("a")
        m = bal._model(b)
        m.slots = rng.choice([None, 1, 2, 4, 8])
        m.kv_capacity = rng.choice([None, 500.0, 2000.0, 20000.0])
        m.ext = float(rng.choice([0, 0, 1, 3]))
        b.remote_in_flight = rng.choice([0, 0, 2])
        for _ in range(rng.randrange(0, 10)):
            r = req(prompt=rng.randrange(1, 400), out=rng.randrange(1, 400))
            bal.dispatched(b, r)
            if rng.random() < 0.5:
                clock.t += rng.random()
                bal.first_byte(b, r, 0.1)
        clock.t += rng.random()
        r = req(prompt=rng.randrange(1, 400), out=rng.randrange(1, 400))
        quick = bal.starts_at_once(b, r)
        verdicts.add(quick)
        if quick:
            assert bal.predict([b], r)[0].wait == 0
    assert verdicts == {True, False}  # both ways were exercised
