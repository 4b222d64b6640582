"""The media policy end to end: every row of the table through a real gateway to a simulated backend.

One simulated api_server records what reaches it; one gateway per media configuration of the
table sits in front of it. A refused row must come back as a 400 in the route's error shape,
naming the place, and must leave the backend's record empty. An accepted row must reach the
backend exactly once, carrying the canonical form the policy checked.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import ssl
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import orjson
import pytest
import trustme

from gateway.config.core import DEFAULT_DROP_FIELDS
from gateway.state.keys import hash_key, new_key
from gateway.filters.media import MediaPolicy
from support import GatewayServer, Sim
from test_media_fetch import PNG, MediaServer, fetcher
from test_media_policy import (
    CASES,
    D_PNG,
    MEDIA_CONFIGS,
    MODEL,
    NARROW_KEY,
    NARROW_KEY_DOMAINS,
    ROUTE_PATHS,
    Case,
    context,
    policy_for,
    refused_count,
    value_at,
)

pytestmark = pytest.mark.e2e

BACKEND_PATHS = set(ROUTE_PATHS.values())


@dataclass
class Env:
    sim: Sim
    clients: dict[tuple[str, str | None], httpx.Client]  # (config, key name) -> client

    def forwarded(self) -> list[dict[str, Any]]:
        return [r for r in self.sim.requests() if r["method"] == "POST" and r["path"] in BACKEND_PATHS]


@pytest.fixture(scope="module")
def env(keys) -> Iterator[Env]:
    narrow = new_key()
    auth = {"keys": [*keys.entries, {"name": "narrow", "hash": hash_key(narrow), "media_allowed_domains": NARROW_KEY_DOMAINS}]}
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(Sim(MODEL, api_key="backend-secret"))
        clients: dict[tuple[str, str | None], httpx.Client] = {}
        for name, media in MEDIA_CONFIGS.items():
            gw = stack.enter_context(
                GatewayServer(
                    {
                        "auth": auth,
                        "backends": [{"url": sim.url, "api_key": "backend-secret", "name": "sim"}],
                        "health": {"interval": 0.2, "timeout": 1.0},
                        "media": copy.deepcopy(media),
                    }
                )
            )
            for key_name, key in ((None, keys.alice), ("narrow", narrow)):
                clients[(name, key_name)] = stack.enter_context(
                    httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {key}", "content-type": "application/json"}, timeout=20)
                )
        yield Env(sim, clients)


def expected_forwarded(case: Case) -> dict[str, Any]:
    """The body as the gateway should forward it: engine knobs dropped, media canonicalised."""
    body = {k: v for k, v in copy.deepcopy(case.body).items() if k not in DEFAULT_DROP_FIELDS}
    assert policy_for(case.config).check_body(context(case.route, body, NARROW_KEY if case.key == "narrow" else None)) is None
    return body


def assert_refused_in_route_shape(r: httpx.Response, route: str, reason: str | None, param: str | None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()
    if route in ("messages", "count_tokens"):
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        if param:
            assert param in err["error"]["message"]
    else:
        if reason:
            assert err["error"]["code"] == reason, err
        if param:
            assert err["error"]["param"] == param, err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_media_table_through_the_gateway(env: Env, case: Case):
    env.sim.clear()
    client = env.clients[(case.config, case.key)]
    before = refused_count(case.expect)
    r = client.post(ROUTE_PATHS[case.route], content=orjson.dumps(case.body))
    if case.expect != "ok":
        assert_refused_in_route_shape(r, case.route, case.expect, case.param)
        assert env.forwarded() == [], "a refused request reached the backend"
        assert refused_count(case.expect) == before + 1
        return
    got = env.forwarded()
    assert len(got) == 1, f"expected exactly one forwarded request, got {len(got)} (gateway said {r.status_code}: {r.text[:300]})"
    recorded = got[0]["body"]
    want = expected_forwarded(case)
    for name in ("messages", "input", "system", "image_data", "prompt"):
        assert recorded.get(name) == want.get(name), name
    if case.canonical is not None:
        assert value_at(recorded, case.param) == case.canonical


# Rows that only exist as raw bytes: what JSON lets a client write that a dict cannot hold.
IMG = "https://images.example.com/a.png"
RAW_CASES = [
    (
        "duplicate url keys",
        "chat",
        b'{"model":"test-model","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"' + IMG.encode() + b'","url":"file:///etc/passwd"}}]}]}',
        None,
        None,
    ),
    (
        "duplicate type keys",
        "chat",
        b'{"model":"test-model","messages":[{"role":"user","content":[{"type":"text","type":"image_url","image_url":"file:///etc/passwd"}]}]}',
        None,
        None,
    ),
    (
        "duplicate source keys",
        "messages",
        b'{"model":"test-model","max_tokens":4,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"'
        + IMG.encode()
        + b'"},"source":{"type":"url","url":"/etc/passwd"}}]}]}',
        None,
        None,
    ),
    (
        "file scheme as a JSON unicode escape",
        "chat",
        b'{"model":"test-model","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"\\u0066ile:///etc/passwd"}}]}]}',
        "url_scheme_not_allowed",
        "messages[0].content[0].image_url.url",
    ),
    (
        "escaped slashes around userinfo",
        "chat",
        b'{"model":"test-model","messages":[{"role":"user","content":[{"type":"image_url","image_url":"https:\\/\\/images.example.com@evil.com\\/"}]}]}',
        "url_userinfo",
        "messages[0].content[0].image_url",
    ),
    (
        "escaped NUL in the host",
        "chat",
        b'{"model":"test-model","messages":[{"role":"user","content":[{"type":"image_url","image_url":"https://images.example.com\\u0000.evil.com/"}]}]}',
        "url_bad_character",
        "messages[0].content[0].image_url",
    ),
    (
        "escaped fullwidth dot",
        "chat",
        b'{"model":"test-model","messages":[{"role":"user","content":[{"type":"image_url","image_url":"https://images\\uff0eexample.com/"}]}]}',
        "url_bad_character",
        "messages[0].content[0].image_url",
    ),
    (
        "lone surrogate escape",
        "chat",
        b'{"model":"test-model","messages":[{"role":"user","content":[{"type":"image_url","image_url":"https://images.example.com/\\ud800"}]}]}',
        None,
        None,
    ),
]


@pytest.mark.parametrize("id, route, raw, reason, param", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_raw_bodies_never_reach_the_backend(env: Env, id: str, route: str, raw: bytes, reason: str | None, param: str | None):
    env.sim.clear()
    r = env.clients[("main", None)].post(ROUTE_PATHS[route], content=raw)
    assert_refused_in_route_shape(r, route, reason, param)
    assert env.forwarded() == []


def test_openai_sdk_image_request_is_forwarded_canonical(env: Env, keys):
    import openai

    env.sim.clear()
    base = str(env.clients[("main", None)].base_url)
    with openai.OpenAI(base_url=base + "/v1", api_key=keys.alice, max_retries=0, timeout=20) as c:
        c.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "HTTPS://Images.Example.COM/a.png"}}]}],
        )
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(
                model=MODEL,
                max_tokens=4,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
            )
    assert exc.value.body["param"] == "messages[0].content[0].image_url.url"
    got = env.forwarded()
    assert len(got) == 1
    assert got[0]["body"]["messages"][0]["content"][1]["image_url"]["url"] == "https://images.example.com/a.png"


def test_anthropic_sdk_refusal_names_the_place(env: Env, keys):
    import anthropic

    env.sim.clear()
    base = str(env.clients[("main", None)].base_url)
    with anthropic.Anthropic(base_url=base, api_key=keys.alice, max_retries=0, timeout=20) as c:
        with pytest.raises(anthropic.BadRequestError) as exc:
            c.messages.create(
                model=MODEL,
                max_tokens=4,
                messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://169.254.169.254/latest/"}}]}],
            )
    assert "messages[0].content[0].source.url" in str(exc.value)
    assert env.forwarded() == []


def test_dns_check_refuses_an_allowed_host_that_resolves_to_loopback(env: Env, keys):
    config = {
        "auth": {"keys": keys.entries},
        "backends": [{"url": env.sim.url, "api_key": "backend-secret", "name": "sim"}],
        "health": {"interval": 0.2, "timeout": 1.0},
        "media": {"allowed_domains": ["localhost"], "resolve_dns": True, "dns_timeout": 5},
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "https://localhost/a.png"}]}]}
    with GatewayServer(config) as gw, httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {keys.alice}"}, timeout=20) as c:
        env.sim.clear()
        before = refused_count("dns_non_global")
        r = c.post("/v1/chat/completions", json=body)
        assert_refused_in_route_shape(r, "chat", "dns_non_global", "messages[0].content[0].image_url")
        assert env.forwarded() == []
        assert refused_count("dns_non_global") == before + 1
        r = c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": D_PNG}]}]})
        assert len(env.forwarded()) == 1, r.text


def test_inline_fetch_forwards_only_data_urls(env: Env, keys):
    """fetch: inline through a real gateway: the backend receives the bytes, never a URL to fetch."""
    ca = trustme.CA()
    server = MediaServer(ca)
    client_ssl = ssl.create_default_context()
    ca.configure_trust(client_ssl)
    config = {
        "auth": {"keys": keys.entries},
        "backends": [{"url": env.sim.url, "api_key": "backend-secret", "name": "sim"}],
        "health": {"interval": 0.2, "timeout": 1.0},
        "media": {"allowed_domains": [f"media.test:{server.port}"], "fetch": "inline"},
    }
    try:
        with GatewayServer(config) as gw, httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {keys.alice}"}, timeout=20) as c:
            # the one test-only part: names answered locally and the local server's loopback address let through
            gw.gateway.asgi().media = MediaPolicy(gw.config.media, fetcher=fetcher(client_ssl))
            env.sim.clear()
            url = server.url("/redirect-relative")
            body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            got = env.forwarded()
            assert len(got) == 1
            assert got[0]["body"]["messages"][0]["content"][0]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(PNG).decode()
            env.sim.clear()
            r = c.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": server.url("/page.html")}}]}]})
            assert_refused_in_route_shape(r, "messages", None, "messages[0].content[0].source.url")
            assert "fetched content is not one of the allowed types" in r.json()["error"]["message"]
            assert env.forwarded() == []
    finally:
        server.stop()


def test_inline_fetch_refuses_a_name_that_resolves_to_loopback(env: Env, keys):
    """The real resolver and the real address check: localhost is allowed by name, refused by address."""
    config = {
        "auth": {"keys": keys.entries},
        "backends": [{"url": env.sim.url, "api_key": "backend-secret", "name": "sim"}],
        "health": {"interval": 0.2, "timeout": 1.0},
        "media": {"allowed_domains": ["localhost"], "fetch": "inline", "fetch_timeout": 5},
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "https://localhost/a.png"}]}]}
    with GatewayServer(config) as gw, httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {keys.alice}"}, timeout=20) as c:
        env.sim.clear()
        before = refused_count("dns_non_global")
        r = c.post("/v1/chat/completions", json=body)
        assert_refused_in_route_shape(r, "chat", "dns_non_global", "messages[0].content[0].image_url")
        assert env.forwarded() == []
        assert refused_count("dns_non_global") == before + 1
