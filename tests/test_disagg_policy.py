"""Choosing prefill and decode instances (gateway/routing/pd_policy.py); retries across instances end to end."""

from __future__ import annotations

import httpx
import pytest

from gateway.routing.pd_policy import PDPicker
from gateway.routing.pool import Backend
from support import GatewayServer, wait_until
from test_disagg_e2e import ds, instances, pd_config, recorded, sim_control

pytestmark = pytest.mark.e2e


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
