"""CORS for browser clients (server.cors.allow_origins) and GET /v1/models/{id}."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.config import ConfigError, parse_config
from support import gateway_with_sims

pytestmark = pytest.mark.e2e

MODEL = "test-model"
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def setup(keys):
    with gateway_with_sims(keys, 1, server={"cors": {"allow_origins": [ORIGIN], "max_age": 120}}) as (gw, sims):
        yield gw, keys


def test_preflight_from_an_allowed_origin_is_answered_without_a_key(setup):
    gw, _ = setup
    r = httpx.options(gw.url + "/v1/chat/completions", headers={"origin": ORIGIN, "access-control-request-method": "POST", "access-control-request-headers": "authorization, content-type"})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-methods"] == "POST"
    assert "authorization" in r.headers["access-control-allow-headers"] and r.headers["access-control-max-age"] == "120"


@pytest.mark.parametrize("origin,method,path", [
    ("https://evil.example.com", "POST", "/v1/chat/completions"),  # origin not allowed
    (ORIGIN, "DELETE", "/v1/chat/completions"),  # method the route does not take
    (ORIGIN, "POST", "/admin/backends"),  # a path we do not serve
])
def test_other_preflights_get_no_cors_grant(setup, origin, method, path):
    gw, _ = setup
    r = httpx.options(gw.url + path, headers={"origin": origin, "access-control-request-method": method})
    assert r.status_code in (404, 405)
    assert "access-control-allow-methods" not in r.headers  # without it the browser blocks the request
    if origin != ORIGIN:
        assert "access-control-allow-origin" not in r.headers


def test_answers_to_an_allowed_origin_carry_the_grant_and_expose_the_request_id(setup):
    gw, keys = setup
    h = {"authorization": f"Bearer {keys.alice}", "origin": ORIGIN}
    ok = httpx.post(gw.url + "/v1/chat/completions", headers=h, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    refused = httpx.post(gw.url + "/v1/chat/completions", headers={"origin": ORIGIN}, json={})
    for r in (ok, refused):
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in r.headers["access-control-expose-headers"]
    other = httpx.get(gw.url + "/health", headers={"origin": "https://evil.example.com"})
    assert "access-control-allow-origin" not in other.headers and other.headers["vary"] == "origin"


def test_cors_origins_are_validated():
    with pytest.raises(ConfigError) as exc:
        parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1"}], "server": {"cors": {"allow_origins": ["https://ok.example.com", "https://bad.example.com/path"]}}})
    assert exc.value.problems == ["server.cors.allow_origins[1]: 'https://bad.example.com/path' is not an origin; write scheme://host[:port] with no path, or '*'"]


def test_one_model_by_id_with_the_sdk(setup):
    gw, keys = setup
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=keys.alice, max_retries=0) as c:
        m = c.models.retrieve(MODEL)
        assert m.id == MODEL and m.object == "model"
        with pytest.raises(openai.NotFoundError) as exc:
            c.models.retrieve("no-such-model")
        assert exc.value.body["code"] == "model_not_found"


def test_a_model_the_key_may_not_use_reads_as_not_found(setup):
    gw, keys = setup
    r = httpx.get(gw.url + f"/v1/models/{MODEL}", headers={"authorization": f"Bearer {keys.bob}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(gw.url + f"/v1/models/{MODEL}").status_code == 401
