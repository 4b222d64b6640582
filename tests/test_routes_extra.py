"""lmdeploy's extra inference routes: /generate, /pooling, /v1/encode, /get_ppl.

Each is off unless the key lists it (`auth.keys[].routes`) and the model enables it
(`models.<name>.routes`); bodies get the same strict parse, size cap and media policy as the others;
`input_ids` passes on /generate only.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from gateway.config import ConfigError, parse_config
from gateway.state.keys import hash_key, new_key
from support import GatewayServer, Sim, gateway_config

pytestmark = pytest.mark.e2e

EXTRA = ("/generate", "/pooling", "/v1/encode", "/get_ppl")
BODIES = {
    "/generate": {"model": "m", "prompt": "hello", "max_tokens": 3},
    "/pooling": {"model": "m", "input": "hello"},
    "/v1/encode": {"model": "m", "input": ["a b", "c"]},
    "/get_ppl": {"model": "m", "input": [1, 2, 3]},
}


@pytest.fixture(scope="module")
def setup():
    rl_key, plain_key, gen_only = new_key(), new_key(), new_key()
    sim = Sim("m", api_key="backend-secret")
    sim2 = Sim("other", api_key="backend-secret")
    keys = [
        {"name": "rl", "hash": hash_key(rl_key), "routes": ["/v1/chat/completions", *EXTRA]},
        {"name": "plain", "hash": hash_key(plain_key)},
        {"name": "gen", "hash": hash_key(gen_only), "routes": ["/generate"]},
    ]
    cfg = {
        "auth": {"keys": keys},
        "backends": [{"url": sim.url, "api_key": "backend-secret"}, {"url": sim2.url, "api_key": "backend-secret"}],
        "health": {"interval": 0.2, "timeout": 1.0},
        "limits": {"max_body_bytes": 4096},
        "models": {"m": {"routes": list(EXTRA)}},  # "other" enables none
    }
    try:
        with GatewayServer(cfg) as gw:
            yield gw, sim, {"rl": rl_key, "plain": plain_key, "gen": gen_only}
    finally:
        sim.stop()
        sim2.stop()


def post(gw, key, path, body, **kw):
    return httpx.post(gw.url + path, headers={"authorization": f"Bearer {key}"}, json=body, timeout=10, trust_env=False, **kw)


@pytest.mark.parametrize("path", EXTRA)
def test_allowed_when_key_and_model_enable_it_with_lmdeploys_shape(setup, path):
    gw, sim, keys = setup
    r = post(gw, keys["rl"], path, BODIES[path])
    assert r.status_code == 200, r.text
    data = r.json()
    if path == "/generate":
        assert set(data) == {"text", "output_ids", "meta_info"} and data["meta_info"]["completion_tokens"] == 3
        assert set(data["meta_info"]) == {"prompt_tokens", "completion_tokens", "finish_reason", "output_token_logprobs", "routed_experts"}
    elif path == "/pooling":
        assert data["object"] == "list" and data["data"][0]["object"] == "pooling"
    elif path == "/v1/encode":
        assert data["length"] == [len(ids) for ids in data["input_ids"]]
    else:
        assert isinstance(data["ppl"], float)


@pytest.mark.parametrize("path", EXTRA)
def test_refused_per_key_before_the_body_and_never_forwarded(setup, path):
    gw, sim, keys = setup
    sim.clear()
    r = post(gw, keys["plain"], path, BODIES[path])
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    if path != "/generate":
        r = post(gw, keys["gen"], path, BODIES[path])
        assert r.status_code == 403
    assert sim.requests() == []


@pytest.mark.parametrize("path", EXTRA)
def test_refused_for_a_model_that_does_not_enable_it(setup, path):
    gw, sim, keys = setup
    r = post(gw, keys["rl"], path, {**BODIES[path], "model": "other"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "route_not_enabled" and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path", EXTRA)
def test_body_caps_and_strict_json_apply(setup, path):
    gw, sim, keys = setup
    sim.clear()
    big = {**BODIES[path], "input": "x" * 5000, "prompt": "x" * 5000}
    assert post(gw, keys["rl"], path, big).status_code == 413
    r = httpx.post(gw.url + path, headers={"authorization": f"Bearer {keys['rl']}", "content-type": "application/json"},
                   content=b'{"model": "m", "model": "m", "input": "a"}', trust_env=False)
    assert r.status_code == 400 and "Duplicate key" in r.json()["error"]["message"]
    r = httpx.post(gw.url + path, headers={"authorization": f"Bearer {keys['rl']}", "content-type": "text/plain"}, content=b"{}", trust_env=False)
    assert r.status_code == 415
    assert sim.requests() == []


def test_input_ids_pass_on_generate_only(setup):
    gw, sim, keys = setup
    sim.clear()
    r = post(gw, keys["rl"], "/generate", {"model": "m", "input_ids": [5, 6, 7], "max_tokens": 2, "session_id": 99})
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 3
    r = post(gw, keys["rl"], "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "input_ids": [1], "max_tokens": 1})
    assert r.status_code == 200
    bodies = [x["body"] for x in sim.requests()]
    assert bodies[0]["input_ids"] == [5, 6, 7] and "session_id" not in bodies[0]
    assert "input_ids" not in bodies[1]


def test_generate_image_data_goes_through_the_media_policy(setup):
    gw, sim, keys = setup
    sim.clear()
    r = post(gw, keys["rl"], "/generate", {"model": "m", "prompt": "x", "image_data": "file:///etc/passwd"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data"
    assert sim.requests() == []


def test_config_names_the_bad_route_and_the_choices():
    key = {"name": "k", "hash": hash_key(new_key()), "routes": ["/generat"]}
    with pytest.raises(ConfigError) as err:
        parse_config({"auth": {"keys": [key]}, "backends": [{"url": "http://127.0.0.1:1"}], "models": {"m": {"routes": ["/terminate"]}}})
    text = "\n".join(err.value.problems)
    assert "auth.keys[0].routes[0]: '/generat' is not a forwarded route; choose from:" in text and "/generate" in text
    assert "models.m.routes[0]: '/terminate' is not a route a model can enable; choose from: /generate, /pooling, /v1/encode, /get_ppl" in text
    assert orjson.dumps(text)  # plain text, no traceback
