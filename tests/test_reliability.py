"""Defined behaviour when things go wrong: dead backends, resets, 5xx, timeouts, no backend at all."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from support import GatewayServer, Sim, free_port, gateway_config, gateway_with_sims, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"
MSG = [{"role": "user", "content": "hi"}]


def sdk(gw, key):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_dead_backend_is_retried_on_another_before_any_byte(keys):
    """A refused connection costs the client nothing: the request goes to the other backend."""
    # round_robin: the dead backend is certainly picked within two requests
    with gateway_with_sims(keys, 2, health={"interval": 30, "timeout": 1}, balancer={"policy": "round_robin"}) as (gw, sims):
        wait_until(lambda: all(b.healthy for b in gw.gateway.pool), 10, what="both healthy")
        sims[0].kill()  # the health checker will not notice for 30 s: only the retry can save us
        with sdk(gw, keys.alice) as c:
            for _ in range(6):
                assert c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).choices
        dead = next(b for b in gw.gateway.pool if b.url == sims[0].url)
        assert not dead.healthy and dead.health_status == "unreachable"


def test_backend_503_is_retried_elsewhere_and_counted(keys):
    with gateway_with_sims(keys, 2) as (gw, sims):
        for s in sims:
            s.control(fail_next={"count": 1, "status": 503})
        with sdk(gw, keys.alice) as c:
            # Whichever backend is picked first answers 503; the retry lands on the other, which
            # also fails once: the second 503 reaches the client (one retry, bounded).
            with pytest.raises(openai.InternalServerError) as exc:
                c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
            assert exc.value.status_code == 503
            assert c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).choices
        metrics = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {keys.alice}"}).text
        assert 'gateway_retries_total{reason="before_first_byte"}' in metrics


def test_reset_without_response_is_retried(keys):
    with gateway_with_sims(keys, 2) as (gw, sims):
        sims[0].control(drop_next=5)
        sims[1].control(drop_next=5)
        with sdk(gw, keys.alice) as c:
            with pytest.raises(openai.InternalServerError) as exc:
                c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
        assert exc.value.status_code == 502 and exc.value.body["code"] == "bad_gateway"


def test_no_backend_at_all_is_503_service_unavailable(keys):
    port = free_port()  # nothing listens here
    cfg = gateway_config(keys, [{"url": f"http://127.0.0.1:{port}", "models": [MODEL]}])
    with GatewayServer(cfg, wait_healthy=False) as gw:
        with sdk(gw, keys.alice) as c:
            with pytest.raises(openai.InternalServerError) as exc:
                c.chat.completions.create(model=MODEL, messages=MSG)
        assert exc.value.status_code == 503 and exc.value.body["code"] == "service_unavailable"
        assert str(port) not in str(exc.value.body)
        r = httpx.get(gw.url + "/ready")
        assert r.status_code == 503 and r.json()["status"] == "not_ready"


def test_first_byte_timeout_is_504_and_cancels_upstream(keys):
    with gateway_with_sims(keys, 1, timeouts={"first_byte": 0.5}) as (gw, sims):
        sims[0].control(hang_next=1)
        t0 = time.monotonic()
        with sdk(gw, keys.alice) as c:
            with pytest.raises(openai.InternalServerError) as exc:
                c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
        assert exc.value.status_code == 504 and exc.value.body["code"] == "gateway_timeout"
        assert time.monotonic() - t0 < 5


def test_idle_timeout_mid_stream_ends_with_error_event(keys):
    with gateway_with_sims(keys, 1, timeouts={"idle": 0.3}) as (gw, sims):
        sims[0].control(tpot=1.0)  # one token a second: far past the idle deadline
        try:
            r = httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {keys.alice}"},
                           json={"model": MODEL, "messages": MSG, "max_tokens": 5, "stream": True}, timeout=30)
            assert r.status_code == 200
            assert b"upstream_stream_error" in r.content and b"[DONE]" not in r.content
        finally:
            sims[0].control(tpot=0.005)


def test_sleeping_backend_leaves_rotation_and_returns(keys):
    with gateway_with_sims(keys, 1) as (gw, sims):
        sims[0].control(health="sleeping")
        wait_until(lambda: not any(b.healthy for b in gw.gateway.pool), 5, what="backend out of rotation")
        with sdk(gw, keys.alice) as c:
            with pytest.raises(openai.InternalServerError) as exc:
                c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
            assert exc.value.status_code == 503
            sims[0].control(health="healthy")
            wait_until(lambda: all(b.healthy for b in gw.gateway.pool), 5, what="backend back")
            assert c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).choices


def test_consecutive_5xx_eject_the_backend_for_a_while(keys):
    with gateway_with_sims(keys, 2, health={"interval": 0.2, "timeout": 1, "failures_to_eject": 2, "ejection_base": 30}, balancer={"retries": 0}) as (gw, sims):
        bad = next(b for b in gw.gateway.pool if b.url == sims[0].url)
        sims[0].control(fail_next={"count": 100, "status": 500})
        with sdk(gw, keys.alice) as c:
            codes = []
            for _ in range(12):
                try:
                    c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
                    codes.append(200)
                except openai.InternalServerError as exc:
                    codes.append(exc.status_code)
        assert codes.count(500) == 2  # then ejected: everything else went to the healthy one
        assert bad.ejected_until > time.monotonic()


def test_metrics_need_an_admin_key(keys):
    with gateway_with_sims(keys, 1) as (gw, _):
        r = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {keys.bob}"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        with openai.OpenAI(base_url=gw.url, api_key=keys.bob, max_retries=0) as c:
            with pytest.raises(openai.PermissionDeniedError):
                c.get("/metrics", cast_to=httpx.Response)


def test_unreachable_sim_backend_keeps_model_known(keys):
    with Sim(MODEL, api_key="backend-secret") as sim:
        cfg = gateway_config(keys, [{"url": sim.url, "api_key": "backend-secret"}])
        with GatewayServer(cfg) as gw:
            sim.kill()
            wait_until(lambda: not any(b.healthy for b in gw.gateway.pool), 5, what="backend down")
            with sdk(gw, keys.alice) as c:
                with pytest.raises(openai.InternalServerError) as exc:
                    c.chat.completions.create(model=MODEL, messages=MSG)
            assert exc.value.status_code == 503  # known model, no healthy backend: not a 404


def test_access_log_names_keys_by_id_and_never_logs_secrets(keys, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="gateway")
    with gateway_with_sims(keys, 1, server={"access_log": True}) as (gw, _):
        with sdk(gw, keys.alice) as c:
            c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
        httpx.post(gw.url + "/v1/chat/completions?api_key=sk-in-query", headers={"authorization": "Bearer sk-wrong-key"}, json={})
    text = caplog.text
    assert "key=alice/" in text and '"POST /v1/chat/completions" 200' in text
    assert keys.alice not in text and "sk-wrong-key" not in text and "sk-in-query" not in text and "backend-secret" not in text


def test_rate_limited_key_gets_429_with_retry_after(keys):
    from gateway.state.keys import hash_key, new_key

    limited = new_key()
    entries = keys.entries + [{"name": "limited", "hash": hash_key(limited), "rate_limit_rpm": 3}]
    with Sim(MODEL, api_key="backend-secret") as sim:
        cfg = gateway_config(keys, [{"url": sim.url, "api_key": "backend-secret"}])
        cfg["auth"] = {"keys": entries}
        with GatewayServer(cfg) as gw:
            with sdk(gw, limited) as c:
                for _ in range(3):
                    assert c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1).choices
                sim.clear()
                with pytest.raises(openai.RateLimitError) as exc:
                    c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
            assert exc.value.body["code"] == "rate_limit_exceeded"
            assert 1 <= int(exc.value.response.headers["retry-after"]) <= 60  # when the oldest of the last minute leaves the window
            assert sim.requests() == []
            with sdk(gw, keys.alice) as c:  # other keys are not affected
                assert c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1).choices


def test_rate_limit_admits_the_limit_in_any_minute():
    from gateway.config import ApiKeyConfig
    from gateway.state.limits import LocalLimiter

    now = [0.0]
    key = ApiKeyConfig(name="k", hash="sha256:" + "0" * 64, rate_limit_rpm=60)
    limit = LocalLimiter(clock=lambda: now[0])
    assert all(limit.admit(key, 0, "").ok for _ in range(60))  # a full bucket: a burst of 60
    assert limit.admit(key, 0, "").reason == "rpm"
    now[0] += 59.0  # a sliding minute: still full
    assert not limit.admit(key, 0, "").ok
    now[0] += 1.0  # the burst has left the window
    assert all(limit.admit(key, 0, "").ok for _ in range(60)) and not limit.admit(key, 0, "").ok


def test_the_app_scrapes_backend_metrics_for_the_balancer(keys):
    with gateway_with_sims(keys, 1, sim_args=("--metrics-interval", "0"), balancer={"scrape_interval": 0.2}) as (gw, _):
        b = next(iter(gw.gateway.pool))
        policy = gw.gateway.balancer
        assert policy.name == "min_expected_latency"

        def scraped() -> bool:
            state = policy.models.get(b)
            return state is not None and state.signals is not None

        wait_until(scraped, 10, what="scraped signals in the policy's state for the backend")


def test_access_log_escapes_client_text(keys, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="gateway")
    with gateway_with_sims(keys, 1, server={"access_log": True}) as (gw, _):
        httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {keys.alice}"},
                   json={"model": "x\n2026 FORGED", "messages": []})
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    assert lines and all("\n" not in line for line in lines)
    assert any("x\\n2026 FORGED" in line for line in lines)
