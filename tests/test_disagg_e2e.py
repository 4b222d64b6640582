"""Prefill/decode disaggregation end to end: simulated prefill and decode instances launched by the gateway.

The simulators speak lmdeploy's DistServe protocol (gateway/sim/distserve.py) and keep a record of
every connection call, migration and free (GET /_sim/distserve), which the assertions read.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from support import GatewayServer, gateway_config, wait_until

pytestmark = pytest.mark.e2e

SIM = {"ttft": 0.005, "tpot": 0.002}


def pd_config(keys, prefill: int = 1, decode: int = 1, sim: dict | None = None, **sections):
    sections.setdefault("health", {"interval": 0.2, "timeout": 5.0})  # a loaded 2-core machine: no false "unhealthy"
    group = {"model": "sim-model", "model_name": "pd", "engine": "sim", "backend": "pytorch", "health_interval": 0.2, "restart_backoff": 0.05}
    return gateway_config(
        keys,
        [],
        launch=[
            {**group, "role": "prefill", "instances": prefill, "sim": {**SIM, **(sim or {})}},
            {**group, "role": "decode", "instances": decode, "sim": {**SIM, **(sim or {})}},
        ],
        models={"pd": {"serving": "distserve"}},
        **sections,
    )


def instances(gw, role: str):
    return [b for b in gw.gateway.pool if b.role == role]


def ds(b) -> dict:
    return httpx.get(b.url + "/_sim/distserve", timeout=5, trust_env=False).json()


def arm(b, **faults) -> None:
    httpx.post(b.url + "/_sim/distserve", json=faults, timeout=5, trust_env=False).raise_for_status()


def sim_control(b, **settings) -> None:
    httpx.post(b.url + "/_sim/control", json=settings, timeout=5, trust_env=False).raise_for_status()


def recorded(b) -> list[dict]:
    return httpx.get(b.url + "/_sim/requests", timeout=5, trust_env=False).json()


@pytest.fixture
def log_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMDEPLOY_GATEWAY_LOG_DIR", str(tmp_path / "logs"))


@pytest.fixture
def pd(keys, log_dir):
    with GatewayServer(pd_config(keys), wait_healthy=False) as gw:
        wait_until(lambda: all(b.healthy for b in gw.gateway.pool) and len(gw.gateway.pool) == 2, 20, 0.02, "prefill and decode healthy")
        yield gw


def client(gw, keys) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=keys.alice, max_retries=0, timeout=20)


def test_chat_and_completions_stream_and_not_go_through_prefill_then_decode(pd, keys):
    p, d = instances(pd, "prefill")[0], instances(pd, "decode")[0]
    c = client(pd, keys)
    chat = c.chat.completions.create(model="pd", messages=[{"role": "user", "content": "hello there"}], max_tokens=5)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
    text = c.completions.create(model="pd", prompt="once upon a time", max_tokens=4)
    assert text.usage.completion_tokens == 4
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(model="pd", messages=[{"role": "user", "content": "x"}], max_tokens=6, stream=True) if ch.choices]
    assert len("".join(pieces).split()) == 6
    streamed = [ch.choices[0].text for ch in c.completions.create(model="pd", prompt="y", max_tokens=3, stream=True) if ch.choices]
    assert len("".join(streamed).split()) == 3

    # Prefill saw exactly what lmdeploy's proxy sends it; decode got the migration request.
    pre = [r["body"] for r in recorded(p) if r["path"] in ("/v1/chat/completions", "/v1/completions")]
    assert len(pre) == 4
    for body in pre:
        assert body["max_tokens"] == 1 and body["stream"] is False and body["with_cache"] is True and body["preserve_cache"] is True
    assert pre[0]["max_completion_tokens"] == 1
    dec = [r["body"] for r in recorded(d) if r["path"] in ("/v1/chat/completions", "/v1/completions")]
    assert len(dec) == 4
    for body in dec:
        m = body["migration_request"]
        assert m["remote_engine_id"] == p.url and m["protocol"] == 2 and m["remote_block_ids"] and m["is_dummy_prefill"] is False
        assert "with_cache" not in body and "preserve_cache" not in body
    # Every prefill's blocks were migrated (and so freed); none left held.
    record = ds(p)
    assert record["held"] == [] and [f["why"] for f in record["frees"]] == ["migrated"] * 4
    assert ds(d)["migrations"] == 4


def test_the_connection_is_set_up_once_per_pair(pd, keys):
    c = client(pd, keys)
    for i in range(5):
        c.chat.completions.create(model="pd", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2)
    p, d = instances(pd, "prefill")[0], instances(pd, "decode")[0]
    for b, other in ((p, d), (d, p)):
        calls = ds(b)["calls"]
        assert calls["engine_info"] == 1 and calls["p2p_initialize"] == 1 and calls["p2p_connect"] == 1
        assert ds(b)["connected"] == [other.url]
    assert pd.gateway.disagg.conns.setups == 1


def test_n_above_one_and_other_routes_are_refused_with_a_clear_400(pd, keys):
    h = {"authorization": f"Bearer {keys.alice}"}
    r = httpx.post(pd.url + "/v1/chat/completions", headers=h, json={"model": "pd", "messages": [{"role": "user", "content": "x"}], "n": 2}, trust_env=False)
    assert r.status_code == 400 and "n > 1" in r.json()["error"]["message"]
    r = httpx.post(pd.url + "/v1/responses", headers=h, json={"model": "pd", "input": "x"}, trust_env=False)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    for b in pd.gateway.pool:
        assert not [x for x in recorded(b) if x["path"] in ("/v1/chat/completions", "/v1/responses")]


def test_decode_that_never_starts_frees_the_prefill_blocks(keys, log_dir):
    with GatewayServer(pd_config(keys, balancer={"retries": 0}), wait_healthy=False) as gw:
        wait_until(lambda: len(gw.gateway.pool) == 2 and all(b.healthy for b in gw.gateway.pool), 20, 0.02, "healthy")
        p, d = instances(gw, "prefill")[0], instances(gw, "decode")[0]
        sim_control(d, fail_next={"count": 1, "status": 503})
        r = httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {keys.alice}"},
                       json={"model": "pd", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}, timeout=10, trust_env=False)
        assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"
        wait_until(lambda: ds(p)["frees"], 5, 0.02, "the free")
        record = ds(p)
        assert record["held"] == [] and record["frees"][0]["why"] == "free_cache" and record["frees"][0]["held"] is True


def test_decode_dying_mid_stream_ends_with_an_error_event_and_the_prefill_cache_is_freed(pd, keys):
    p, d = instances(pd, "prefill")[0], instances(pd, "decode")[0]
    sim_control(d, crash_stream_after=2)
    h = {"authorization": f"Bearer {keys.alice}"}
    body = {"model": "pd", "messages": [{"role": "user", "content": "long answer"}], "max_tokens": 50, "stream": True}
    with httpx.stream("POST", pd.url + "/v1/chat/completions", headers=h, json=body, timeout=10, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    last = json.loads(events[-1][5:])
    assert last["error"]["code"] == "upstream_stream_error"
    session = [x["body"]["migration_request"]["remote_session_id"] for x in recorded(d) if x["path"] == "/v1/chat/completions"][-1]
    wait_until(lambda: any(f["why"] == "free_cache" and f["session_id"] == session for f in ds(p)["frees"]), 5, 0.02, "the gateway's free")
    assert ds(p)["held"] == []


def test_client_disconnect_frees_the_prefill_cache(keys, log_dir):
    with GatewayServer(pd_config(keys, sim={"tpot": 0.05}), wait_healthy=False) as gw:
        wait_until(lambda: len(gw.gateway.pool) == 2 and all(b.healthy for b in gw.gateway.pool), 20, 0.02, "healthy")
        p, d = instances(gw, "prefill")[0], instances(gw, "decode")[0]
        h = {"authorization": f"Bearer {keys.alice}"}
        body = {"model": "pd", "messages": [{"role": "user", "content": "go"}], "max_tokens": 500, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", headers=h, json=body, timeout=10, trust_env=False) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # one token, then hang up
        session = [x["body"]["migration_request"]["remote_session_id"] for x in recorded(d) if x["path"] == "/v1/chat/completions"][-1]
        wait_until(lambda: any(f["why"] == "free_cache" and f["session_id"] == session for f in ds(p)["frees"]), 5, 0.02, "the gateway's free")
        wait_until(lambda: httpx.get(d.url + "/_sim/stats", trust_env=False).json()["aborted"] == 1, 5, 0.02, "decode aborted")


def test_prefill_dying_after_prefill_gives_a_defined_error_then_the_pair_reconnects(keys, log_dir):
    with GatewayServer(pd_config(keys), wait_healthy=False) as gw:
        wait_until(lambda: len(gw.gateway.pool) == 2 and all(b.healthy for b in gw.gateway.pool), 20, 0.02, "healthy")
        p, d = instances(gw, "prefill")[0], instances(gw, "decode")[0]
        c = client(gw, keys)
        c.chat.completions.create(model="pd", messages=[{"role": "user", "content": "warm"}], max_tokens=2)  # the pair connects
        arm(p, exit_after_prefill=True)
        r = httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {keys.alice}"},
                       json={"model": "pd", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}, timeout=10, trust_env=False)
        assert r.status_code in (502, 503), r.text
        assert r.json()["error"]["code"] in ("bad_gateway", "service_unavailable")
        assert "127.0.0.1" not in r.text
        # The decode instance refused to migrate from the dead prefill; it produced nothing.
        assert ds(d)["migrations"] == 1
        # The link was dropped on the decode end when the prefill instance died; after its restart the pair reconnects.
        wait_until(lambda: ds(d)["connected"] == [], 10, 0.05, "the decode end dropped the link")
        assert ds(d)["calls"]["p2p_drop_connect"] == 1
        wait_until(lambda: p.healthy, 20, 0.05, "the prefill instance restarted")
        ok = c.chat.completions.create(model="pd", messages=[{"role": "user", "content": "again"}], max_tokens=2)
        assert ok.usage.completion_tokens == 2
        assert ds(p)["calls"]["p2p_connect"] == 1 and ds(d)["calls"]["p2p_connect"] == 2


def test_distserve_routes_and_engine_knobs_from_a_client_never_reach_a_backend(pd, keys):
    h = {"authorization": f"Bearer {keys.alice}"}
    with httpx.Client(base_url=pd.url, headers=h, timeout=10, trust_env=False) as http:
        for path in ("/distserve/engine_info", "/distserve/p2p_initialize", "/distserve/p2p_connect", "/distserve/p2p_drop_connect", "/distserve/free_cache"):
            assert http.post(path, json={"remote_engine_id": "x", "remote_session_id": 1}).status_code == 404
            assert http.get(path).status_code == 404
        evil = {"protocol": 2, "remote_engine_id": "http://evil.example", "remote_session_id": 7, "remote_token_id": 1, "remote_block_ids": [1]}
        r = http.post("/v1/chat/completions", json={"model": "pd", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                    "migration_request": evil, "with_cache": "evil", "preserve_cache": "evil"})
        assert r.status_code == 200
    for b in pd.gateway.pool:
        for x in recorded(b):
            assert not x["path"].startswith("/distserve/free_cache") and "evil" not in json.dumps(x["body"])
            assert x["path"] != "/distserve/p2p_drop_connect"
