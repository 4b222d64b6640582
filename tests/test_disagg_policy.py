"""Choosing prefill and decode instances (gateway/routing/pd_policy.py); retries across instances end to end."""

from __future__ import annotations

import math

import httpx
import pytest

from gateway.config.balancer import DEFAULT_PRIORITY, PRIORITY_NAMES, QueueConfig
from gateway.config.core import HealthConfig
from gateway.config.disagg import ModelServing
from gateway.routing.disagg import PD_KEEP_SHARE, PDDispatcher
from gateway.routing.pd_policy import PDPicker, PDRequest
from gateway.routing.policies import Outcome
from gateway.routing.pool import Backend, BackendPool
from gateway.routing.queue import KEEP_SHARE, Admission, Waiter
from gateway.routing.signals import Signals
from support import GatewayServer, wait_until
from test_disagg_e2e import ds, instances, pd_config, recorded, sim_control

pytestmark = pytest.mark.e2e
INTERACTIVE = PRIORITY_NAMES["interactive"]
BATCH = PRIORITY_NAMES["batch"]


def backends(n: int, role: str) -> list[Backend]:
    return [Backend(id=f"{role}{i}", url=f"http://127.0.0.1:{1000 + i}", role=role, healthy=True) for i in range(n)]


def test_prefill_goes_where_the_predicted_wait_is_shortest():
    picker = PDPicker(affinity_slack=0.0)
    a, b = backends(2, "prefill")
    picker.prefill_started(a, 4000)
    assert picker.pick_prefill([a, b], 1000, b"") is b
    picker.prefill_done(a, 4000, seconds=0.2)
    picker.prefill_started(b, 100)
    assert picker.pick_prefill([a, b], 1000, b"") is a
    # A slow instance learns its own rate: equal queues, the faster one wins.
    picker.prefill_done(b, 100, seconds=1.0)
    assert picker.predicted_wait(b, 1000) > picker.predicted_wait(a, 1000)



def pd_req(tokens: int = 100, decode_tokens: int = 200) -> PDRequest:
    return PDRequest(model="m", prompt_tokens=tokens, prompt=b"p", decode_tokens=decode_tokens)


@pytest.mark.parametrize(
    ("slots", "ours", "theirs", "queued_tokens", "hold", "reserve", "fits"),
    [
        (None, 0, 0, 0, 0.0, 0.0, True),  # idle
        (None, 3, 0, 0, 0.0, 0.0, True),  # slots unknown, nothing queued ahead
        (None, 1, 0, 40000, 0.5, 0.0, False),  # 2 s of prefill queued here (1/20000 s a token) > hold
        (None, 1, 0, 4000, 0.5, 0.0, True),  # 0.2 s <= hold
        (2, 1, 0, 0, 0.5, 0.0, True),  # one slot of two free
        (2, 1, 1, 0, 0.5, 0.0, False),  # slots - ours - theirs = 0
        (1, 0, 1, 0, 0.5, 0.0, False),  # idle here, busy through another replica: not idle
        (4, 1, 1, 0, 0.5, 0.5, False),  # a lower class leaves 2 of 4 free: 2 free is not enough
        (4, 1, 0, 0, 0.5, 0.5, True),
    ],
)
def test_prefill_room_counts_every_replicas_requests_and_the_queued_prefill(slots, ours, theirs, queued_tokens, hold, reserve, fits):
    picker = PDPicker()
    (p,) = backends(1, "prefill")
    (d,) = backends(1, "decode")
    p.slots = slots
    for _ in range(ours):
        picker.dispatched(p, pd_req(tokens=0))
    if queued_tokens:
        picker.prefill_started(p, queued_tokens)
    p.remote_in_flight = theirs
    assert (picker.room([p], [d], pd_req(), hold, reserve) == [p]) is fits


def test_nothing_starts_while_no_decode_instance_has_kv_room_unless_one_is_idle():
    picker = PDPicker()
    (p,) = backends(1, "prefill")
    d1, d2 = backends(2, "decode")
    for d in (d1, d2):
        picker.set_capacity(d, 1000)
    picker.decode_started(d1, 900)
    d1.in_flight = 1
    assert picker.room([p], [d1], pd_req(decode_tokens=200), 0.5) == []  # 900 + 200 > 1000
    assert picker.room([p], [d1, d2], pd_req(decode_tokens=200), 0.5) == [p]
    picker.decode_started(d2, 900)
    d2.remote_in_flight = 1
    assert picker.room([p], [d1, d2], pd_req(decode_tokens=200), 0.5) == []
    assert picker.room([p], [d1, d2], pd_req(decode_tokens=2000), 0.5) == []
    d1.in_flight = 0
    picker.decode_done(d1, 900)
    assert picker.room([p], [d1, d2], pd_req(decode_tokens=2000), 0.5) == [p]  # too big for any, but d1 is idle: never stuck


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("slots", "ours", "theirs", "prefilling", "fits"),
    [
        (None, 5, 0, 5, True),  # slots unknown: they limit nothing (KV still does)
        (2, 1, 0, 0, True),
        (2, 2, 0, 0, False),  # every slot taken by ours
        (2, 1, 1, 0, False),  # ... by ours and another replica's
        (2, 0, 0, 2, False),  # idle, but two requests prefilling will take both slots
        (3, 0, 1, 1, True),  # one of three left for this one
    ],
)
def test_decode_slots_count_every_replicas_decodes_and_the_requests_prefilling(slots, ours, theirs, prefilling, fits):
    picker = PDPicker()
    p, other = backends(2, "prefill")
    (d,) = backends(1, "decode")
    d.slots = slots
    for _ in range(ours):
        picker.decode_started(d, 10, 10)
        d.in_flight += 1
    d.remote_in_flight = theirs
    other.remote_in_flight = prefilling  # prefills run elsewhere count as much as ours on p
    assert (picker.room([p, other], [d], pd_req(), 0.5) == [p, other]) is fits


def test_a_full_decode_side_holds_the_request_in_the_queue_until_a_decode_ends():
    clock = Clock()
    picker = PDPicker(clock=clock)
    (p,) = backends(1, "prefill")
    p.slots = 8
    (d,) = backends(1, "decode")
    d.slots = 1
    adm = Admission(QueueConfig(), picker, lambda model: [p], clock, room=lambda ps, req, prio: picker.room(ps, [d], req, 0.5))  # HOLD_WAIT: 0.5
    first, second = pd_req(), pd_req()
    assert adm.admit(first, "k", DEFAULT_PRIORITY) is p  # the decode slot is free
    w = adm.admit(second, "k", DEFAULT_PRIORITY)  # p has 7 free slots, but first will take the one decode slot
    assert isinstance(w, Waiter)
    picker.completed(p, first, Outcome(status=200, ok=True, ttft=0.1))
    run = picker.decode_started(d, first.decode_tokens, 10)  # as the dispatcher does, then it wakes the queue
    d.in_flight += 1
    assert adm.drain("m") == [] and adm.waiting() == 1  # decoding now: still full
    clock.now += 2.0
    d.in_flight -= 1
    picker.decode_done(d, first.decode_tokens, run, ok=True)
    assert adm.drain("m") == [w] and w.backend is p and p.in_flight == 1


def test_a_decode_slot_due_to_free_within_hold_counts_as_free():
    clock = Clock()
    picker = PDPicker(clock=clock)
    (p,) = backends(1, "prefill")
    (d,) = backends(1, "decode")
    d.slots = 1
    run = picker.decode_started(d, 0, 100)
    clock.now += 1.0
    picker.decode_done(d, 0, run, ok=True)  # 100 tokens in 1 s: 10 ms a token
    picker.decode_started(d, 0, 1000).first_at = clock.now  # streaming from now: due in 10 s
    waiting = picker.decode_started(Backend(id="w", url="http://127.0.0.1:3", role="decode"), 0, 10)
    clock.now += 50
    assert waiting.due(clock.now, 0.01) == pytest.approx(clock.now + 0.1)  # no token yet: all its output is ahead
    clock.now -= 50
    d.in_flight = 1
    fit, wait = picker.room_or_wait([p], [d], pd_req(), hold=0.5)
    assert fit == [] and wait == pytest.approx(10 - 0.5 - 100 / 20000)  # the queue looks again then: nothing else would wake it
    other = Backend(id="remote", url="http://127.0.0.1:2", role="decode", healthy=True, slots=1, remote_in_flight=2)
    assert picker.decode_slot_in([d, other], 0) == pytest.approx(10)
    assert picker.decode_slot_in([d, other], 1) == math.inf  # the other's ends are not known here
    clock.now += 9.6  # due in 0.4 s
    assert picker.room([p], [d], pd_req(), hold=0.5) == [p]
    assert picker.room([p], [d], pd_req(), hold=0.1) == []
    # A long prompt prefills for 1 s (20000 tokens at the default rate): the slot frees before it needs it.
    assert picker.room([p], [d], pd_req(tokens=20000), hold=0.1) == [p]
    # Unknown speed (no decode finished there yet): no prediction.
    e = Backend(id="other", url="http://127.0.0.1:1", role="decode", healthy=True)
    e.slots, e.in_flight = 1, 1
    picker.decode_started(e, 0, 1)
    clock.now += 100
    assert picker.room([p], [e], pd_req(), hold=0.5) == []


def test_decode_slots_come_from_config_then_launch_and_rise_with_what_metrics_show():
    picker = PDPicker()
    (d,) = backends(1, "decode")
    assert picker.decode_slots(d) is None
    d.slots = 4  # launched: the group's max_batch_size
    assert picker.decode_slots(d) == 4
    assert PDPicker(slots=2).decode_slots(d) == 2  # balancer.slots wins
    picker.observe_signals(d, Signals(running=6, waiting=0, kv_usage=0.3), changed=True)
    assert picker.decode_slots(d) == 6  # more running than assumed
    u = Backend(id="other", url="http://127.0.0.1:1", role="decode", healthy=True)
    picker.observe_signals(u, Signals(running=3, waiting=1, kv_usage=0.3), changed=True)
    assert picker.decode_slots(u) is None  # no real queue: nothing learnt
    picker.observe_signals(u, Signals(running=3, waiting=3, kv_usage=0.3), changed=True)
    assert picker.decode_slots(u) == 3  # a queue while KV has room: every slot is taken


def test_dispatched_and_completed_hold_the_prefill_reservation_once():
    picker = PDPicker(affinity_slack=0.0)
    a, b = backends(2, "prefill")
    r = pd_req(tokens=4000)
    picker.dispatched(a, r)
    assert a.in_flight == 1 and picker.wait_ahead(a) > 0
    assert picker.pick([a, b], pd_req()) is b  # the queued prefill counts
    picker.completed(a, r, Outcome(status=200, ok=True, ttft=0.4))
    assert a.in_flight == 0 and picker.wait_ahead(a) == 0
    assert picker.predicted_wait(a, 1000) > picker.predicted_wait(b, 1000)  # learnt 0.1 ms a token, slower than the prior

def test_prefix_affinity_keeps_a_prompt_start_on_one_instance_within_the_slack():
    picker = PDPicker(affinity_slack=0.5)
    ps = backends(4, "prefill")
    shared = b"shared system prompt " * 30  # 630 bytes: longer than the 512 that decide
    homes = {picker.pick_prefill(ps, 1000, shared + tail).id for tail in (b"x", b"y", b"z" * 900)}
    assert len(homes) == 1
    others = {picker.pick_prefill(ps, 1000, bytes([65 + i]) * 600).id for i in range(12)}
    assert len(others) > 1  # different starts spread out
    home = next(b for b in ps if b.id in homes)
    picker.prefill_started(home, 200_000)  # far beyond the slack: affinity yields
    assert picker.pick_prefill(ps, 1000, shared) is not home


def solo_prefills(picker: PDPicker, clock: "Clock", b: Backend, sizes: list[int], fixed: float = 0.04, per_token: float = 1 / 8000) -> None:
    """Prefills that start on an idle b and take fixed + per_token x tokens."""
    for t in sizes:
        picker.prefill_started(b, t)
        clock.now += fixed + t * per_token
        picker.prefill_done(b, t, seconds=fixed + t * per_token)


def test_prefill_speed_is_a_fixed_cost_plus_a_cost_per_token_learnt_from_idle_starts():
    clock = Clock()
    picker = PDPicker(clock=clock)
    (a,) = backends(1, "prefill")
    solo_prefills(picker, clock, a, [500, 1000, 1500] * 8)  # short prompts only, as an instance kept for interactive ones sees
    # One rate learnt from them (0.16 ms a token at 1,000) would predict 0.64 s for a long prompt.
    assert picker.predicted_wait(a, 4000) == pytest.approx(0.04 + 4000 / 8000, abs=0.01)
    # A prefill that queued behind another took its wait as well: that is not speed.
    picker.prefill_started(a, 1000)
    picker.prefill_started(a, 1000)
    clock.now += 0.165
    picker.prefill_done(a, 1000, seconds=0.165)
    clock.now += 0.165
    picker.prefill_done(a, 1000, seconds=0.33)
    assert picker.predicted_wait(a, 1000) == pytest.approx(0.165, abs=0.005)


def test_what_is_left_of_a_running_prefill_counts_not_all_of_it():
    clock = Clock()
    picker = PDPicker(affinity_slack=0.0, clock=clock)
    a, b = backends(2, "prefill")
    for x in (a, b):
        solo_prefills(picker, clock, x, [500, 1500] * 4)
    picker.prefill_started(a, 4000)  # a batch prefill: 0.54 s
    clock.now += 0.45
    picker.prefill_started(b, 1000)  # an interactive one, just started: 0.165 s
    assert picker.wait_ahead(a) == pytest.approx(0.09, abs=0.005)
    assert picker.pick([a, b], pd_req(tokens=1000)) is a  # a starts it first
    clock.now += 0.2  # a's prefill overran its prediction: nothing is predicted left, not less than nothing
    assert picker.wait_ahead(a) == 0.0 and picker.predicted_wait(a, 1000) == pytest.approx(0.165, abs=0.005)


def test_a_prompt_start_not_sent_lately_goes_to_the_best_instance_and_one_sent_lately_stays_within_the_slack():
    picker = PDPicker(affinity_slack=0.5)
    a, b = backends(2, "prefill")
    picker.prefill_started(a, 4000)  # 0.2 s at the prior: within the slack, yet nothing cached there to wait for
    assert {picker.pick_prefill([a, b], 1000, bytes([65 + i]) * 600).id for i in range(12)} == {b.id}
    seen = bytes([65]) * 600  # went to b
    picker.prefill_started(b, 2000)  # b is now the slower by 0.1 s: within the slack, it stays
    assert picker.pick_prefill([a, b], 1000, seen) is b
    picker.prefill_started(b, 200_000)  # far beyond the slack: affinity yields
    assert picker.pick_prefill([a, b], 1000, seen) is a


def test_decode_prefers_light_load_and_kv_room():
    picker = PDPicker()
    a, b = backends(2, "decode")
    picker.set_capacity(a, 10_000)
    picker.set_capacity(b, 10_000)
    picker.decode_started(a, 1000)
    assert picker.pick_decode([a, b], 1000) is b
    picker.decode_started(b, 8500)  # b would overflow with 2000 more; a still fits
    assert picker.pick_decode([a, b], 2000) is a
    picker.decode_done(b, 8500)
    picker.decode_started(a, 1000)
    assert picker.pick_decode([a, b], 1000) is b
    a.slots = b.slots = 2
    b.remote_in_flight = 2  # b's slots taken through another replica: a, though it runs more of ours
    a.in_flight = 1
    assert picker.pick_decode([a, b], 1000) is a


def pd_dispatcher(pd_keep_share: float | None, clock) -> tuple[PDDispatcher, list[Backend], list[Backend]]:
    """A dispatcher with its queue over two prefill and two decode instances of model m; ``pd_keep_share``
    replaces its queue's (``disagg.PD_KEEP_SHARE``, a constant) when given."""
    pool = BackendPool(HealthConfig())
    ps, dec = backends(2, "prefill"), backends(2, "decode")
    for b in ps + dec:
        b.models = frozenset({"m"})
        pool.add(b)
    disp = PDDispatcher(pool, {"m": ModelServing("m", serving="distserve")})
    disp.enable_queue(QueueConfig(), clock)
    if pd_keep_share is not None:
        disp.queue.admission.keep_share = pd_keep_share
    return disp, ps, dec


@pytest.mark.parametrize("pd_keep_share, kept", [(None, True), (0.0, False)])  # None: the default, 1.0
def test_lower_classes_keep_off_the_prefill_and_decode_instances_most_interactive_requests_use(pd_keep_share, kept):
    clock = Clock()
    disp, (p0, p1), (d0, d1) = pd_dispatcher(pd_keep_share, clock)
    adm = disp.queue.admission
    disp.pool.set_draining(p1, True)  # meanwhile the interactive requests can only go to p0 and d0
    for i in range(20):
        r = pd_req(tokens=2000)
        assert adm.admit(r, "ui", INTERACTIVE) is p0
        disp.picker.completed(p0, r, Outcome(status=200, ok=True, ttft=0.1))
        assert disp.pick_decode(r, [d0]) is d0
    disp.pool.set_draining(p1, False)
    # Both prefill instances idle, the same prompt start (one affinity home): without the rule the first
    # batch prefill goes to either and the second (0.1 s queued ahead is more than it may find) to the other.
    flood = [PDRequest(model="m", prompt_tokens=2000, prompt=b"batch %d" % i, decode_tokens=2100) for i in range(2)]
    got = [adm.admit(r, "bulk", BATCH) for r in flood]
    if kept:
        assert got[0] is p1 and isinstance(got[1], Waiter), got
        adm.cancel(got[1])
    else:
        assert {got[0], got[1]} == {p0, p1}, got
    for r, b in zip(flood, got):
        if isinstance(b, Backend):  # the prefills are done
            disp.picker.completed(b, r, Outcome(status=200, ok=True, ttft=0.1))
    # The decode (the queue set each request's class): d0 is the lighter, yet a batch request leaves it to the interactive ones.
    batch, interactive = pd_req(), pd_req()
    batch.priority, interactive.priority = BATCH, INTERACTIVE
    disp.picker.decode_started(d1, 100)
    assert disp.pick_decode(batch, [d0, d1]) is (d1 if kept else d0)
    assert disp.pick_decode(interactive, [d0, d1]) is d0
    # Room (the dispatcher's, which the queue asks): with d1 without a free slot, a batch request waits
    # (d0 is not its to take) while an interactive one starts.
    d1.slots, d1.in_flight = 1, 1
    assert (adm.room([p0], batch, BATCH) == []) is kept
    assert adm.room([p0], interactive, INTERACTIVE) == [p0]
    clock.now += 31.0  # no interactive request lately: every instance takes batch work again
    assert disp.pick_decode(batch, [d0, d1]) is d0 and adm.room([p0], batch, BATCH) == [p0]


def test_keys_of_a_class_take_turns_for_the_prefill_instances():
    clock = Clock()
    disp, (p0, p1), _ = pd_dispatcher(None, clock)
    adm = disp.queue.admission
    for p in (p0, p1):
        p.slots, p.in_flight = 1, 1  # both prefill slots taken: every request waits
    burst = [adm.admit(pd_req(tokens=2000), "bulk", BATCH) for _ in range(4)]
    other = adm.admit(pd_req(tokens=2000), "other", BATCH)
    assert all(isinstance(w, Waiter) for w in [*burst, other])
    order = []
    for _ in range(3):
        p0.in_flight = 0  # its prefill is done: one waiter may start
        (w,) = adm.drain("m")
        order.append(w)
    # Deficit round robin: the other key's one request goes second, not after the burst.
    assert order == [burst[0], other, burst[1]]


def test_pd_keep_share_is_the_dispatchers_and_keep_share_the_routers():
    disp, _, _ = pd_dispatcher(None, Clock())
    assert PD_KEEP_SHARE == 1.0 and disp.queue.admission.keep_share == PD_KEEP_SHARE
    assert Admission(QueueConfig(), disp.picker, lambda model: [], Clock()).keep_share == KEEP_SHARE == 1.5


def test_a_failed_decode_is_retried_on_another_and_its_prefill_blocks_freed(keys, tmp_path, monkeypatch):
    monkeypatch.setenv("LMDEPLOY_GATEWAY_LOG_DIR", str(tmp_path))
    with GatewayServer(pd_config(keys, decode=2), wait_healthy=False) as gw:
        wait_until(lambda: len(gw.gateway.pool) == 3 and all(b.healthy for b in gw.gateway.pool), 20, 0.02, "healthy")
        p = instances(gw, "prefill")[0]
        bad = instances(gw, "decode")[0]  # idle decode instances tie: the first in the pool is picked first
        sim_control(bad, fail_next={"count": 5, "status": 503})
        h = {"authorization": f"Bearer {keys.alice}"}
        r = httpx.post(gw.url + "/v1/chat/completions", headers=h, json={"model": "pd", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                       timeout=10, trust_env=False)
        assert r.status_code == 200, r.text
        got = [x for x in recorded(bad) if x["path"] == "/v1/chat/completions"]
        assert len(got) == 1  # tried once, then the other decode instance
        sid = got[0]["body"]["migration_request"]["remote_session_id"]
        wait_until(lambda: any(f["session_id"] == sid and f["why"] == "free_cache" and f["held"] for f in ds(p)["frees"]), 5, 0.02, "free")
        assert len([x for x in recorded(p) if x["path"] == "/v1/chat/completions"]) == 2  # a fresh prefill for the retry
        assert ds(p)["held"] == []


def test_a_prefill_instance_answering_503_is_skipped(keys, tmp_path, monkeypatch):
    monkeypatch.setenv("LMDEPLOY_GATEWAY_LOG_DIR", str(tmp_path))
    with GatewayServer(pd_config(keys, prefill=2, balancer={"retries": 2}), wait_healthy=False) as gw:
        wait_until(lambda: len(gw.gateway.pool) == 3 and all(b.healthy for b in gw.gateway.pool), 20, 0.02, "healthy")
        for p in instances(gw, "prefill"):
            sim_control(p, fail_next={"count": 1, "status": 503})
        h = {"authorization": f"Bearer {keys.alice}"}
        r = httpx.post(gw.url + "/v1/completions", headers=h, json={"model": "pd", "prompt": "x", "max_tokens": 2}, timeout=10, trust_env=False)
        assert r.status_code == 200, r.text  # each prefill instance answered 503 once; the third attempt succeeded
        seen = [len([x for x in recorded(p) if x["path"] == "/v1/completions"]) for p in instances(gw, "prefill")]
        assert sorted(seen) == [1, 2]  # the retry went to the other instance first
