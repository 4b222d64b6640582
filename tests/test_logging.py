"""Structured logs: one JSON access line per request, checked field by field after a scripted mix
of traffic; pool events as structured lines; a request id on every answer; never a key, a prompt
or a media URL in any line."""

from __future__ import annotations

import io
import logging

import httpx
import orjson
import pytest

from gateway import logs
from gateway.state.keys import hash_key, key_id, new_key
from support import Sim, gateway_config, GatewayServer

pytestmark = pytest.mark.e2e

MODEL = "test-model"
PROMPT = "the secret prompt text 7f3a"
MEDIA_URL = "https://evil.example.net/cat.png?token=hunter2"


class Captured:
    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(logs.JsonFormatter())
        self.logger = logging.getLogger("gateway")
        self.level = self.logger.level

    def __enter__(self) -> "Captured":
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)

    def lines(self) -> list[dict]:
        return [orjson.loads(line) for line in self.stream.getvalue().splitlines() if line.strip()]

    def access(self) -> list[dict]:
        return [line for line in self.lines() if line.get("event") == "access"]


@pytest.fixture(scope="module")
def env():
    user, limited = new_key(), new_key()
    keys = type("K", (), {"entries": [
        {"name": "user", "hash": hash_key(user), "models": [MODEL]},
        {"name": "limited", "hash": hash_key(limited), "rate_limit_rpm": 1},
    ]})()
    with Captured() as captured, Sim(MODEL, api_key="backend-secret") as sim:
        cfg = gateway_config(keys, [{"url": sim.url, "api_key": "backend-secret", "name": "sim-0"}], log={"format": "json"})
        cfg["server"] = {"access_log": True}
        with GatewayServer(cfg) as gw:
            yield gw, sim, user, limited, captured


def chat(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, **extra}


def test_access_lines_field_by_field_after_a_mix_of_traffic(env):
    gw, sim, user, limited, captured = env
    auth = {"authorization": f"Bearer {user}"}
    answers: list[tuple[str, httpx.Response]] = []
    with httpx.Client(base_url=gw.url, timeout=20) as c:
        def go(name: str, method: str, path: str, **kw) -> None:
            answers.append((name, c.request(method, path, **kw)))

        go("ok", "POST", "/v1/chat/completions", json=chat(), headers={**auth, "x-request-id": "client-chosen-1"})
        go("stream", "POST", "/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True}), headers=auth)
        go("anthropic", "POST", "/v1/messages", json={"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": PROMPT}]}, headers={"x-api-key": user, "anthropic-version": "2023-06-01"})
        go("no_key", "POST", "/v1/chat/completions", json=chat())
        go("bad_key", "POST", "/v1/chat/completions", json=chat(), headers={"authorization": "Bearer sk-not-a-real-key-000000000000"})
        go("model", "POST", "/v1/chat/completions", json={**chat(), "model": "other-model"}, headers=auth)
        go("media", "POST", "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": MEDIA_URL}}]}]}, headers=auth)
        go("json", "POST", "/v1/chat/completions", content=b"{not json", headers={**auth, "content-type": "application/json"})
        go("type", "POST", "/v1/chat/completions", content=b"x", headers={**auth, "content-type": "text/plain"})
        go("path", "GET", "/v1/chat%2Fcompletions", headers=auth)
        go("rate1", "POST", "/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {limited}"})
        go("rate2", "POST", "/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {limited}"})
        sim.control(drop_next=2)
        go("backend", "POST", "/v1/chat/completions", json=chat(), headers=auth)
        go("health", "GET", "/health")

    expected = {
        "ok": (200, None), "stream": (200, None), "anthropic": (200, None), "no_key": (401, "missing_api_key"),
        "bad_key": (401, "invalid_api_key"), "model": (404, "model_not_found"), "media": (400, None),
        "json": (400, None), "type": (415, None), "path": (400, "path_not_canonical"), "rate1": (200, None),
        "rate2": (429, "rate_limited"), "backend": (502, "upstream_unreachable"), "health": (200, None),
    }
    for name, r in answers:
        status, _ = expected[name]
        assert r.status_code == status, (name, r.status_code, r.text)
        assert r.headers.get("x-request-id"), name  # every answer, refusals and local routes too
    by_name = dict(answers)
    assert by_name["ok"].headers["x-request-id"] == "client-chosen-1"
    assert by_name["anthropic"].headers["request-id"] == by_name["anthropic"].headers["x-request-id"]

    lines = captured.access()
    by_id = {line["request_id"]: line for line in lines}
    for name, r in answers:
        line = by_id[r.headers["x-request-id"]]
        status, reason = expected[name]
        assert line["status"] == status, name
        assert isinstance(line["duration_ms"], float) and line["duration_ms"] >= 0
        if reason is not None:
            assert line["refusal"] == reason, (name, line)
        elif status >= 400:
            assert line["refusal"], (name, line)
        else:
            assert line["refusal"] is None, (name, line)

    ok = by_id["client-chosen-1"]
    assert ok["key"] == f"user/{key_id(hash_key(user))}"
    assert ok["model"] == MODEL and ok["backend"] == "sim-0" and ok["route"] == "chat" and ok["method"] == "POST"
    assert ok["completion_tokens"] == 3 and ok["prompt_tokens"] > 0 and ok["ttfb_ms"] > 0
    stream = by_id[by_name["stream"].headers["x-request-id"]]
    assert stream["completion_tokens"] == 3 and stream["ttfb_ms"] > 0 and stream["backend"] == "sim-0"
    assert by_id[by_name["no_key"].headers["x-request-id"]]["key"] is None
    assert by_id[by_name["path"].headers["x-request-id"]]["route"] == "unrouted"
    assert by_id[by_name["media"].headers["x-request-id"]]["refusal"] == "domain_not_allowed"
    backend = by_id[by_name["backend"].headers["x-request-id"]]
    assert backend["backend"] == "sim-0" and backend["completion_tokens"] is None

    text = captured.stream.getvalue()
    for secret in (user, limited, hash_key(user), "backend-secret", PROMPT, MEDIA_URL, "evil.example.net", "hunter2"):
        assert secret not in text


def test_pool_events_are_structured_lines(env):
    _, _, _, _, captured = env
    health = [line for line in captured.lines() if line.get("event") == "backend_health"]
    assert any(line["backend"] == "sim-0" and line["healthy"] is True and line["status"] == "healthy" for line in health)
    assert all(line["logger"] == "gateway.pool" and line["level"] == "info" for line in health)


def test_text_format_carries_the_same_fields_on_one_line():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.TextFormatter())
    record = logging.LogRecord("gateway.access", logging.INFO, __file__, 1, '%s "%s"', ("1.2.3.4:5", "GET /health"), None)
    record.fields = logs.access_fields(
        request_id="abc", method="GET", path="/health", route="health", status=200, duration=0.0012, client="1.2.3.4:5",
        key=None, model="a model", backend=None, ttfb=None, prompt_tokens=None, completion_tokens=None, refusal=None,
    )
    handler.emit(record)
    line = stream.getvalue()
    assert line.count("\n") == 1
    assert "request_id=abc" in line and "route=health" in line and "ttfb_ms=" not in line and "backend=" not in line


def test_json_formatter_keeps_one_line_per_record_even_with_a_traceback():
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        import sys

        record = logging.LogRecord("gateway", logging.ERROR, __file__, 1, "failed: %s", ("x\ny",), sys.exc_info())
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    data = orjson.loads(line)
    assert data["msg"] == "failed: x\ny" and "ValueError" in data["exception"] and data["level"] == "error"


def test_log_format_is_validated_with_the_choices():
    from gateway.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as exc:
        parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1"}], "log": {"format": "jsonl"}})
    assert exc.value.problems == ["log.format: 'jsonl' is not a valid choice; choose one of: text, json (did you mean 'json'?)"]
