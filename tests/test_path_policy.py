"""Route allow-list: admin routes, /nodes and every odd spelling of a path never reach a backend.

Requests go over raw sockets so that no client library normalises the request-target first; a
simulated api_server records everything it receives, so "never reached" is checked, not assumed.
"""

from __future__ import annotations

import socket

import orjson
import pytest

from gateway.filters.paths import PathPolicy
from support import gateway_with_sims

pytestmark = pytest.mark.e2e

BODY = orjson.dumps({"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def raw_http(port: int, request_line: bytes, headers: list[bytes], body: bytes = b"") -> tuple[int, bytes]:
    """Send exactly these bytes; return (status, body). A dropped connection reads as status 0."""
    msg = request_line + b"\r\n" + b"\r\n".join([b"Host: 127.0.0.1", b"Connection: close", *headers])
    msg += b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(msg)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    if not data.startswith(b"HTTP/1.1 "):
        return 0, data
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), rest


@pytest.fixture(scope="module")
def setup(keys):
    with gateway_with_sims(keys, 1) as (gw, sims):
        yield gw, sims[0], keys


ADMIN_AND_HIDDEN = [
    ("GET", "/terminate"),
    ("POST", "/sleep"),
    ("POST", "/wakeup"),
    ("GET", "/is_sleeping"),
    ("POST", "/update_weights"),
    ("POST", "/init_weights_update_group"),
    ("POST", "/update_weights_from_distributed"),
    ("POST", "/destroy_weights_update_group"),
    ("POST", "/abort_request"),
    ("GET", "/distserve/engine_info"),
    ("POST", "/distserve/p2p_initialize"),
    ("POST", "/distserve/p2p_connect"),
    ("POST", "/distserve/p2p_drop_connect"),
    ("POST", "/distserve/free_cache"),
    ("POST", "/generate"),
    ("POST", "/pooling"),
    ("POST", "/get_ppl"),
    ("POST", "/v1/encode"),
    ("POST", "/v1/embeddings"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/"),
    ("GET", "/anthropic/v1/models"),
    ("GET", "/nodes/status"),
    ("POST", "/nodes/add"),
    ("POST", "/nodes/remove"),
    ("POST", "/nodes/terminate"),
    ("GET", "/nodes/terminate_all"),
    ("POST", "/V1/chat/completions"),
    ("POST", "/v1/Chat/Completions"),
    ("PUT", "/v1/chat/completions"),
    ("DELETE", "/v1/chat/completions"),
    ("GET", "/v1/chat/completions"),
    ("POST", "/v1/models"),
    ("POST", "/health"),
]


@pytest.mark.parametrize("method,path", ADMIN_AND_HIDDEN)
def test_admin_and_unlisted_routes_are_answered_by_the_gateway(setup, method, path):
    gw, sim, keys = setup
    sim.clear()
    status, body = raw_http(gw.port, f"{method} {path} HTTP/1.1".encode(), [b"Authorization: Bearer " + keys.alice.encode(), b"Content-Type: application/json"], BODY)
    assert status in (404, 405), (path, status, body)
    assert orjson.loads(body)["error"]["code"] in ("not_found", "method_not_allowed")
    assert sim.requests() == []


NON_CANONICAL = [
    b"/v1/../terminate",
    b"/v1/chat/../../terminate",
    b"/v1/chat/completions/../../../terminate",
    b"/v1/%2e%2e/terminate",
    b"/v1/%2E%2E/terminate",
    b"/v1/.%2e/terminate",
    b"/%74erminate",
    b"/v1/chat%2fcompletions",
    b"/v1/chat%2Fcompletions",
    b"/v1%2fchat%2fcompletions",
    b"/v1/chat/completions%2f..%2f..%2fterminate",
    b"/v1/chat/completions%00",
    b"/v1/chat/completions%20",
    b"/v1/%63hat/completions",
    b"//terminate",
    b"//v1/chat/completions",
    b"/v1//chat/completions",
    b"/v1/chat/completions//",
    b"/v1/chat/completions/",
    b"/v1/./chat/completions",
    b"/./v1/chat/completions",
    b"/v1/chat/completions/.",
    b"/v1/chat/completions/..",
    b"/v1/chat/completions;x=1",
    b"/v1/chat/completions;/../../terminate",
    b"/v1;/chat/completions",
    b"/v1\\chat\\completions",
    b"/v1/chat/completions\\..\\..\\terminate",
    b"/v1/chat/completions\xc0\xae",
    b"/v1/chat/compl\xc3\xa9tions",
    b"/v1/chat/completions\x7f",
    b"/v1/chat/completions%u002e",
    b"/nodes%2fadd",
    b"/%6eodes/add",
    b"/v1/chat/completions%23",
    b"/v1/chat/completions%3fx",
    b"/v1/chat/completions/%2e",
    b"*",
]


@pytest.mark.parametrize("target", NON_CANONICAL, ids=[t.decode("latin-1") for t in NON_CANONICAL])
def test_non_canonical_request_target_is_refused_and_never_reaches_backend(setup, target):
    gw, sim, keys = setup
    sim.clear()
    status, body = raw_http(gw.port, b"POST " + target + b" HTTP/1.1", [b"Authorization: Bearer " + keys.alice.encode(), b"Content-Type: application/json"], BODY)
    # 400 from our path policy, or from uvicorn's parser for bytes it will not even parse.
    assert status in (0, 400, 404), (target, status, body)
    if status == 400 and body.startswith(b"{"):
        assert orjson.loads(body)["error"]["code"] == "invalid_path"
    assert sim.requests() == []


def test_absolute_form_target_is_matched_on_its_path_only(setup):
    gw, sim, keys = setup
    sim.clear()
    status, _ = raw_http(gw.port, f"POST http://127.0.0.1:{sim.port}/terminate HTTP/1.1".encode(), [b"Authorization: Bearer " + keys.alice.encode(), b"Content-Type: application/json"], BODY)
    assert status in (400, 404)
    assert sim.requests() == []


def test_rewrite_and_override_headers_are_neither_honoured_nor_forwarded(setup):
    gw, sim, keys = setup
    sim.clear()
    headers = [
        b"Authorization: Bearer " + keys.alice.encode(),
        b"Content-Type: application/json",
        b"X-Original-URL: /terminate",
        b"X-Rewrite-URL: /terminate",
        b"X-HTTP-Method-Override: GET",
        b"X-Forwarded-Host: evil.example",
        b"X-Forwarded-For: 1.2.3.4",
        b"Proxy-Authorization: Basic eDp5",
        b"TE: trailers",
        b"Upgrade: websocket",
        b"Keep-Alive: timeout=5",
        b"Cookie: session=abc",
        b"Anthropic-Version: 2023-06-01",
    ]
    status, _ = raw_http(gw.port, b"POST /v1/chat/completions?target=/terminate HTTP/1.1", headers, BODY)
    assert status == 200
    (rec,) = sim.requests()
    assert rec["path"] == "/v1/chat/completions" and rec["raw_path"] == "/v1/chat/completions" and not rec["query"]
    forwarded = {k.lower() for k in rec["headers"]}
    for name in ("x-original-url", "x-rewrite-url", "x-http-method-override", "x-forwarded-host", "x-forwarded-for",
                 "proxy-authorization", "te", "upgrade", "keep-alive", "cookie"):
        assert name not in forwarded, name
    assert rec["headers"]["authorization"] == "Bearer backend-secret"  # the gateway's key, never the caller's
    assert keys.alice not in orjson.dumps(rec).decode()
    assert rec["headers"]["anthropic-version"] == "2023-06-01"  # allow-listed


def test_gateway_metrics_route_is_the_gateways_own(setup):
    gw, sim, keys = setup
    auth = b"Authorization: Bearer " + keys.alice.encode()
    assert raw_http(gw.port, b"POST /v1/chat/completions HTTP/1.1", [auth, b"Content-Type: application/json"], BODY)[0] == 200
    sim.clear()
    status, body = raw_http(gw.port, b"GET /metrics HTTP/1.1", [auth])
    assert status == 200 and b"gateway_requests_total" in body and b"lmdeploy:" not in body
    assert b"gateway_time_to_first_byte_seconds_count{route=\"chat\"}" in body
    assert sim.requests() == []


@pytest.mark.parametrize(
    "raw,expected",
    [
        (b"/v1/chat/completions", "chat"),
        (b"/v1/messages/count_tokens", "count_tokens"),
        (b"/v1/chat/completions/", 400),  # a trailing slash is another path to some servers
        (b"/v1/%2e%2e/x", 400),
        (b"/v1/x/..", 400),
        (b"/v1/..x", 404),  # a name that merely starts with dots is not a dot segment
        (b"", 400),
    ],
)
def test_path_policy_table(raw, expected):
    out = PathPolicy().resolve("POST", raw, raw.decode("latin-1"))
    if isinstance(expected, str):
        assert out.kind == expected
    else:
        assert out.status == expected
