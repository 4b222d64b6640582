"""The upstream client end to end: relay, stream, errors, retries, cancellation."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from support import gateway_with_sims

pytestmark = pytest.mark.e2e

MODEL = "test-model"


@pytest.fixture(scope="module")
def setup(keys):
    # round_robin: every test can count on both backends being picked
    with gateway_with_sims(keys, 2, balancer={"policy": "round_robin"}) as (gw, sims):
        yield gw, sims, keys


def post(gw, keys, **body):
    return httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {keys.alice}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}, timeout=30)


def test_json_and_stream_are_relayed(setup):
    gw, _, keys = setup
    r = post(gw, keys, max_tokens=3)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = post(gw, keys, max_tokens=3, stream=True)
    assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
    assert len([e for e in r.content.split(b"\n\n") if e.startswith(b"data: {")]) >= 3


def test_upstream_error_status_and_body_are_kept(setup):
    gw, sims, keys = setup
    for s in sims:
        s.control(fail_next={"count": 1, "status": 422, "body": {"error": {"message": "bad thing", "type": "x", "code": "y", "param": None}}})
    r = post(gw, keys, max_tokens=1)
    assert r.status_code == 422 and r.json()["error"]["message"] == "bad thing"
    for s in sims:
        s.control(reset=True)


def test_reset_is_retried_on_the_other_backend(setup):
    gw, sims, keys = setup
    sims[0].control(drop_next=2)
    for _ in range(8):  # whenever the dropping backend is picked, the retry on the other one answers
        assert post(gw, keys, max_tokens=1).status_code == 200
    assert sims[0].stats()["faults_applied"]["drop"] >= 1
    for s in sims:
        s.control(reset=True)


def test_crash_mid_stream_ends_with_error_event(setup):
    gw, sims, keys = setup
    for s in sims:
        s.control(crash_stream_after=2)
    r = post(gw, keys, max_tokens=30, stream=True)
    assert r.status_code == 200 and b"upstream_stream_error" in r.content and b"[DONE]" not in r.content
    for s in sims:
        s.control(reset=True)


def test_client_disconnect_aborts_upstream(setup):
    gw, sims, keys = setup
    before = sum(s.stats()["aborted"] for s in sims)
    for s in sims:
        s.control(tpot=0.5)
    try:
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True})
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as c:
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + keys.alice.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert c.recv(100).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 5
        while sum(s.stats()["aborted"] for s in sims) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(s.stats()["aborted"] for s in sims) == before + 1
    finally:
        for s in sims:
            s.control(reset=True)
