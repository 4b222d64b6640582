"""The simulated api_server (``python -m gateway.sim``), run as a real subprocess on loopback.

Every process a test starts is stopped by that test (context manager or fixture teardown);
every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.sim.config import parse_args
from gateway.sim.engine import Engine, EngineLimits, Timing, step_seconds
from gateway.sim.prefix_cache import PrefixCache
from gateway.sim.process import SimProcess, free_port
from gateway.sim.tokens import count_text_tokens, text_prompt

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
MODEL = "sim-model"
JSON = {"content-type": "application/json"}
ANTHROPIC = {"content-type": "application/json", "anthropic-version": "2023-06-01"}


def _wait(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class SimProc(SimProcess):
    """One simulator subprocess logging to ``tmp``; ``stop()`` always leaves no process behind."""

    def __init__(self, tmp: Path, *args: str, ready: bool = True) -> None:
        port = free_port()
        super().__init__(*args, model=MODEL, port=port, ready=ready, log=tmp / f"sim-{port}.log")


@contextlib.contextmanager
def running_sim(tmp: Path, *args: str, ready: bool = True) -> Iterator[SimProc]:
    sim = SimProc(tmp, *args, ready=ready)
    try:
        yield sim
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def shared_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProc]:
    with running_sim(tmp_path_factory.mktemp("sim"), "--model", "lora-a", "--metrics-interval", "0") as sim:
        yield sim


@pytest.fixture()
def sim(shared_sim: SimProc) -> SimProc:
    """The shared simulator, with faults, health, timing and the request log back to their defaults."""
    shared_sim.control(reset=True, clear_cache=True)
    shared_sim.http.delete("/_sim/requests")
    return shared_sim


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def sse_data(body: bytes) -> list[Any]:
    out: list[Any] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[6:]
            out.append(payload.decode() if payload == b"[DONE]" else orjson.loads(payload))
    return out


def sse_events(body: bytes) -> list[str]:
    return [line[7:].decode() for line in body.split(b"\n") if line.startswith(b"event: ")]


# -- protocols ---------------------------------------------------------------------------------


def test_chat_completion_has_filler_text_and_usage(sim: SimProc) -> None:
    r = sim.http.post("/v1/chat/completions", json=chat(max_tokens=4))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "tok0 tok1 tok2 tok3", "tool_calls": None}
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 4 and usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_output_length_defaults_when_the_request_sets_none(sim: SimProc) -> None:
    body = sim.http.post("/v1/chat/completions", json=chat()).json()
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "stop"
    body = sim.http.post("/v1/chat/completions", json=chat(max_completion_tokens=3, n=2)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 6


def test_chat_stream_sends_a_chunk_per_token_then_usage_and_done(sim: SimProc) -> None:
    r = sim.http.post("/v1/chat/completions", json=chat(max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = sse_data(r.content)
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:3]] == ["tok0", " tok1", " tok2"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[3]["choices"][0]["finish_reason"] == "length"
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 3


def test_chat_stream_without_include_usage_has_no_usage_chunk(sim: SimProc) -> None:
    data = sse_data(sim.http.post("/v1/chat/completions", json=chat(max_tokens=2, stream=True)).content)
    assert data[-1] == "[DONE]" and all("usage" not in c for c in data[:-1])


def test_completions_answer_each_prompt(sim: SimProc) -> None:
    body = sim.http.post("/v1/completions", json={"model": MODEL, "prompt": ["a b", "c d"], "max_tokens": 2}).json()
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["tok0 tok1", "tok0 tok1"]
    assert body["usage"]["completion_tokens"] == 4
    data = sse_data(sim.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}).content)
    assert [d["choices"][0]["text"] for d in data[:2]] == ["tok0", " tok1"] and data[-1] == "[DONE]"


def test_responses_api_object_and_stream_events(sim: SimProc) -> None:
    body = sim.http.post("/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 2}).json()
    assert body["object"] == "response" and body["status"] == "incomplete"
    assert body["output"][0]["content"][0]["text"] == "tok0 tok1"
    assert body["usage"]["output_tokens"] == 2 and body["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    r = sim.http.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}], "stream": True})
    events = sse_events(r.content)
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert events.count("response.output_text.delta") == 16
    assert sim.http.post("/v1/responses", json={"input": "x", "previous_response_id": "r1"}).status_code == 400


def test_messages_need_the_anthropic_version_header(sim: SimProc) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = sim.http.post("/v1/messages", json=body)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "Missing required header: anthropic-version"}}
    r = sim.http.post("/v1/messages", json=body, headers=ANTHROPIC)
    message = r.json()
    assert message["type"] == "message" and message["content"] == [{"type": "text", "text": "tok0 tok1"}]
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 2
    r = sim.http.post("/v1/messages", json={**body, "stream": True}, headers=ANTHROPIC)
    assert sse_events(r.content) == [
        "message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]
    r = sim.http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": body["messages"]}, headers=ANTHROPIC)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    assert sim.http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": body["messages"]}).status_code == 400


def test_models_list_the_main_model_then_the_adapters(sim: SimProc) -> None:
    data = sim.http.get("/v1/models").json()["data"]
    assert [(m["id"], m["owned_by"]) for m in data] == [(MODEL, "lmdeploy"), ("lora-a", "lmdeploy")]
    assert [m["id"] for m in sim.http.get("/anthropic/v1/models").json()["data"]] == [MODEL, "lora-a"]
    assert sim.http.post("/v1/chat/completions", json={**chat(max_tokens=1), "model": "lora-a"}).json()["model"] == "lora-a"


def test_validation_matches_lmdeploy(sim: SimProc) -> None:
    r = sim.http.post("/v1/chat/completions", json={**chat(), "model": "nope"})
    assert r.status_code == 404
    assert r.json() == {"object": "error", "message": "The model 'nope' does not exist.", "type": "not_found_error", "param": "model", "code": 404}
    r = sim.http.post("/v1/chat/completions", content=orjson.dumps(chat()), headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "application/json" in r.json()["message"]
    assert sim.http.post("/v1/chat/completions", content=b"{", headers=JSON).status_code == 400
    assert sim.http.post("/v1/embeddings", json={"input": "x"}).json()["message"] == "Unsupported by turbomind."
    assert sim.http.get("/nodes/status").json() == {"detail": "Not Found"}


def test_auxiliary_routes_answer(sim: SimProc) -> None:
    assert sim.http.post("/v1/encode", json={"input": "hello world"}).json()["length"] == 4
    assert sim.http.post("/generate", json={"prompt": "x", "sampling_params": {"max_new_tokens": 2}}).json()["text"] == "tok0 tok1"
    assert sim.http.post("/pooling", json={"input": ["a", "b"]}).json()["data"][1]["index"] == 1
    assert "ppl" in sim.http.post("/get_ppl", json={"input": [1, 2, 3]}).json()
    assert sim.http.get("/openapi.json").json()["paths"]["/v1/chat/completions"]
    assert sim.http.get("/").status_code == 200


# -- engine model ------------------------------------------------------------------------------


def test_second_identical_long_prompt_hits_the_prefix_cache(sim: SimProc) -> None:
    long = "lorem ipsum dolor sit amet " * 100
    before = sim.stats()
    first = sim.http.post("/v1/chat/completions", json=chat(long, max_tokens=1)).json()["usage"]
    second = sim.http.post("/v1/chat/completions", json=chat(long, max_tokens=1)).json()["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached % 64 == 0 and second["prompt_tokens"] - 64 <= cached < second["prompt_tokens"]
    after = sim.stats()
    assert after["prefix_hits_tokens"] - before["prefix_hits_tokens"] == cached
    assert after["prompt_tokens"] - before["prompt_tokens"] == 2 * first["prompt_tokens"]


@pytest.fixture(scope="module")
def batching_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProc]:
    """10 ms decode steps, 16 batch slots, free prefill, gauges refreshed at start only."""
    args = ("--ttft", "0", "--tpot", "0.01", "--prefill-tokens-per-s", "1e9", "--max-batch-size", "16", "--metrics-interval", "3600")
    with running_sim(tmp_path_factory.mktemp("batching"), *args) as sim:
        yield sim


async def test_concurrent_requests_share_decode_steps(batching_sim: SimProc) -> None:
    # Counted in the engine's decode steps, not in wall-clock time, which a busy machine stretches.
    async with httpx.AsyncClient(base_url=batching_sim.url, timeout=10) as client:
        steps = batching_sim.stats()["steps"]
        t0 = time.monotonic()
        assert (await client.post("/v1/chat/completions", json=chat(max_tokens=30))).status_code == 200
        single = time.monotonic() - t0
        single_steps = batching_sim.stats()["steps"] - steps
        steps = batching_sim.stats()["steps"]
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(max_tokens=30)) for _ in range(16)))
        together_steps = batching_sim.stats()["steps"] - steps
    assert all(r.status_code == 200 for r in replies)
    assert single >= 0.3  # 30 decode steps of 10 ms: a lower bound that load cannot break
    assert 30 <= single_steps <= 31
    assert together_steps < 8 * single_steps, together_steps  # one after another would take 16x


async def test_requests_beyond_the_batch_slots_wait_and_gauges_are_stale(batching_sim: SimProc) -> None:
    async with httpx.AsyncClient(base_url=batching_sim.url, timeout=10) as client:
        calls = asyncio.ensure_future(asyncio.gather(*(client.post("/v1/chat/completions", json=chat(max_tokens=30)) for _ in range(20))))
        seen: dict[str, Any] = {}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not seen:
            stats = (await client.get("/_sim/stats")).json()
            if stats["waiting"] == 4:
                seen = stats
            await asyncio.sleep(0.01)
        metrics = (await client.get("/metrics")).text
        replies = await calls
    assert seen["running"] == 16 and all(r.status_code == 200 for r in replies)
    # Refreshed at start only (interval 3600 s), like lmdeploy's 10 s snapshot.
    assert 'lmdeploy:num_requests_running{engine="0",model_name="sim-model"} 0.0' in metrics


async def test_client_disconnect_aborts_the_stream_and_frees_the_slot(sim: SimProc) -> None:
    before = sim.stats()
    sim.control(tpot=0.05)
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=200, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
    _wait(lambda: sim.stats()["aborted"] == before["aborted"] + 1, 5, "the abort")
    stats = sim.stats()
    assert stats["running"] == 0 and stats["completed"] == before["completed"]


def test_client_disconnect_aborts_a_non_streaming_request(sim: SimProc) -> None:
    before = sim.stats()
    sim.control(ttft=5.0)
    body = orjson.dumps(chat(max_tokens=4))
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait(lambda: sim.stats()["pending"] == 1, 5, "the request to arrive")
    _wait(lambda: sim.stats()["aborted"] == before["aborted"] + 1, 5, "the abort")
    assert sim.stats()["in_flight"] == 0


# -- request log ---------------------------------------------------------------------------------


def test_request_log_keeps_raw_paths_bodies_and_headers(sim: SimProc) -> None:
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as s:
        s.sendall(b"GET /v1/%2e%2e/terminate?x=1 HTTP/1.1\r\nHost: h\r\nX-Dup: a\r\nX-Dup: b\r\nConnection: close\r\n\r\n")
        while s.recv(4096):
            pass
    sim.http.post("/nodes/add", content=b"not json", headers={"content-type": "text/plain"})
    sim.http.post("/v1/chat/completions", json=chat(max_tokens=1))
    sim.http.get("/health")
    sim.http.get("/metrics")
    log = sim.requests()
    assert [(e["method"], e["path"]) for e in log] == [("GET", "/v1/../terminate"), ("POST", "/nodes/add"), ("POST", "/v1/chat/completions")]
    first, second, third = log
    assert first["raw_path"] == "/v1/%2e%2e/terminate" and first["query"] == "x=1"
    assert first["headers"]["x-dup"] == "a, b" and first["body"] is None
    assert second["body"] is None and second["body_text"] == "not json"
    assert third["body"] == chat(max_tokens=1) and third["headers"]["content-type"] == "application/json"
    assert sim.http.delete("/_sim/requests").status_code == 204 and sim.requests() == []


# -- auth ----------------------------------------------------------------------------------------


def test_api_keys_guard_every_route_but_health(tmp_path: Path) -> None:
    with running_sim(tmp_path, "--api-keys", "k1", "k2") as sim:
        h = sim.http
        assert h.get("/health").status_code == 200
        r = h.get("/v1/models")
        assert r.status_code == 401
        assert r.json() == {"object": "error", "message": "Unauthorized.", "type": "authentication_error", "param": None, "code": 401}
        assert h.get("/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert h.get("/v1/models", headers={"authorization": "Basic k1"}).status_code == 401
        assert h.get("/v1/models", headers={"authorization": "bearer k2"}).status_code == 200
        for method, path in (("GET", "/metrics"), ("GET", "/terminate"), ("POST", "/sleep"), ("GET", "/openapi.json")):
            assert h.request(method, path).status_code == 401, path
        r = h.post("/v1/messages", json={}, headers=ANTHROPIC)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and r.json()["type"] == "error"
        assert h.post("/v1/responses", json={}).json()["error"]["code"] == 401
        assert h.get("/nodes/status").status_code == 404  # lmdeploy skips /nodes
        # Recorded before auth: the gateway's tests can see refused requests reached the backend.
        assert ("GET", "/v1/models") in [(e["method"], e["path"]) for e in sim.requests()]


# -- admin routes obey ---------------------------------------------------------------------------


def test_sleep_makes_health_sleeping_and_inference_503(sim: SimProc) -> None:
    assert sim.http.post("/sleep").status_code == 400  # lmdeploy wants a JSON content type here too
    assert sim.http.post("/sleep?level=1", headers=JSON).status_code == 200
    r = sim.http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "sleeping"
    assert sim.http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert sim.http.post("/v1/chat/completions", json=chat()).status_code == 503
    assert sim.http.get("/v1/models").status_code == 200
    assert sim.http.post("/wakeup", headers=JSON).status_code == 200
    assert sim.http.get("/health").json()["status"] == "healthy"
    assert sim.http.post("/v1/chat/completions", json=chat(max_tokens=1)).status_code == 200


def test_terminate_is_refused_without_the_flag(sim: SimProc) -> None:
    r = sim.http.get("/terminate")
    assert r.status_code == 400 and "--allow-terminate-by-client" in r.json()["message"]
    assert sim.proc.poll() is None
    assert sim.http.post("/abort_request", json={"abort_all": True}).status_code == 501


def test_terminate_stops_the_process_when_allowed(tmp_path: Path) -> None:
    with running_sim(tmp_path, "--allow-terminate-by-client") as sim:
        assert sim.http.get("/terminate").status_code == 200
        assert sim.proc.wait(10) == 0


def test_abort_request_aborts_engine_work_when_enabled(tmp_path: Path) -> None:
    with running_sim(tmp_path, "--enable-abort-handling", "--ttft", "5") as sim:
        with httpx.Client(base_url=sim.url, timeout=10) as other:
            result: dict[str, Any] = {}
            t = threading.Thread(target=lambda: result.update(r=other.post("/v1/chat/completions", json=chat(session_id=7))))
            t.start()
            _wait(lambda: sim.stats()["pending"] == 1, 5, "the request to arrive")
            assert sim.http.post("/abort_request", json={"session_id": 8}).status_code == 400
            assert sim.http.post("/abort_request", json={"session_id": 7}).status_code == 200
            t.join(5)
        assert sim.stats()["aborted"] == 1 and result["r"].status_code == 200


# -- faults --------------------------------------------------------------------------------------


def test_fail_next_answers_the_status_then_recovers(sim: SimProc) -> None:
    before = sim.stats()["faults_applied"]
    sim.control(fail_next={"count": 2, "status": 503})
    assert sim.http.get("/v1/models").status_code == 200  # only inference requests take faults
    r = sim.http.post("/v1/chat/completions", json=chat())
    assert r.status_code == 503 and r.json()["type"] == "server_error"
    r = sim.http.post("/v1/messages", json={}, headers=ANTHROPIC)
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    assert sim.http.post("/v1/chat/completions", json=chat(max_tokens=1)).status_code == 200
    sim.control(fail_next={"count": 1, "status": 429, "body": {"custom": True}})
    r = sim.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 429 and r.json() == {"custom": True}
    assert sim.stats()["faults_applied"]["fail"] == before["fail"] + 3


def test_drop_next_closes_the_connection_without_a_response(sim: SimProc) -> None:
    sim.control(drop_next=1)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        sim.http.post("/v1/chat/completions", json=chat())
    assert sim.http.post("/v1/chat/completions", json=chat(max_tokens=1)).status_code == 200


def test_crash_stream_after_cuts_the_stream_without_done(sim: SimProc) -> None:
    before = sim.stats()["faults_applied"]
    sim.control(crash_stream_after=3)
    frames: list[str] = []
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        with sim.http.stream("POST", "/v1/chat/completions", json=chat(max_tokens=10, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    frames.append(line)
    assert len(frames) == 3 and "[DONE]" not in "".join(frames)
    assert sim.stats()["faults_applied"]["crash"] == before["crash"] + 1
    data = sse_data(sim.http.post("/v1/chat/completions", json=chat(max_tokens=2, stream=True)).content)
    assert data[-1] == "[DONE]"  # one stream only


def test_hang_next_never_answers(sim: SimProc) -> None:
    before = sim.stats()["faults_applied"]
    sim.control(hang_next=1)
    with pytest.raises(httpx.ReadTimeout):
        sim.http.post("/v1/chat/completions", json=chat(), timeout=0.3)
    assert sim.stats()["faults_applied"]["hang"] == before["hang"] + 1
    assert sim.http.post("/v1/chat/completions", json=chat(max_tokens=1)).status_code == 200


def test_control_rejects_bad_settings_and_applies_none(sim: SimProc) -> None:
    r = sim.http.post("/_sim/control", json={"drop_next": 1, "bogus": 1, "health": "great"})
    assert r.status_code == 400 and len(r.json()["errors"]) == 2
    assert sim.stats()["faults"]["drop_next"] == 0
    sim.control(health="unhealthy")
    assert sim.http.get("/health").status_code == 503


def test_exit_control_kills_the_process_with_the_code(tmp_path: Path) -> None:
    with running_sim(tmp_path) as sim:
        sim.control(exit=3)
        assert sim.proc.wait(10) == 3


# -- process lifecycle ---------------------------------------------------------------------------


def test_port_opens_after_startup_delay_then_health_leaves_initializing(tmp_path: Path) -> None:
    with running_sim(tmp_path, "--startup-delay", "0.5", "--initializing-for", "0.5", ready=False) as sim:
        with pytest.raises(httpx.ConnectError):
            sim.http.get("/health")
        statuses: list[str] = []

        def healthy() -> bool:
            try:
                r = sim.http.get("/health")
            except httpx.TransportError:
                return False
            statuses.append(r.json()["status"])
            return r.status_code == 200

        _wait(healthy, 10, "health")
        assert statuses[0] == "initializing" and statuses[-1] == "healthy"
        assert sim.http.get("/metrics").text.count("lmdeploy:") > 0
        sim.stop()
        assert f"sim ready on http://127.0.0.1:{sim.port} model={MODEL}" in sim.output()


async def test_sigterm_finishes_in_flight_streams_then_exits_zero(tmp_path: Path) -> None:
    with running_sim(tmp_path, "--ttft", "0", "--tpot", "0.02") as sim:
        async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
            async with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=25, stream=True)) as r:
                lines = []
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and not lines:
                        sim.proc.send_signal(signal.SIGTERM)
                    if line:
                        lines.append(line)
        assert lines[-1] == "data: [DONE]" and len(lines) == 27
        assert await asyncio.to_thread(sim.proc.wait, 10) == 0


def test_metrics_have_the_lmdeploy_names(sim: SimProc) -> None:
    sim.http.post("/v1/chat/completions", json=chat(max_tokens=2))
    text = sim.http.get("/metrics").text
    for name in (
        "lmdeploy:num_requests_running", "lmdeploy:num_requests_waiting", "lmdeploy:gpu_cache_usage_perc",
        "lmdeploy:prefix_cache_hit_rate", "lmdeploy:num_api_requests_routed", "lmdeploy:prompt_tokens_total",
        "lmdeploy:generation_tokens_total", "lmdeploy:cached_tokens_total",
    ):
        assert f'{name}{{engine="0",model_name="{MODEL}"}}' in text, name


# -- units -------------------------------------------------------------------------------------


def test_token_rule_is_four_characters_per_token() -> None:
    assert [count_text_tokens(t) for t in ("", "abc", "abcd", "abcde")] == [1, 1, 1, 2]
    a, b = text_prompt("x" * 256 + "y" * 256, 64), text_prompt("x" * 256 + "z" * 256, 64)
    assert a.tokens == 128 and a.blocks[0] == b.blocks[0] and a.blocks[1] != b.blocks[1]


def test_prefix_cache_evicts_chain_tails_first() -> None:
    cache = PrefixCache()
    cache.insert([1, 2, 3], 10)
    cache.insert([7, 8], 3)  # room for 3: the tail of the older chain goes first
    assert cache.match([1, 2, 3]) == 1 and cache.match([7, 8]) == 2


def test_step_cost_is_prefill_plus_a_decode_pass_that_slows_with_the_batch() -> None:
    timing = Timing(ttft=0, tpot=0.01, speed=2.0, prefill_tokens_per_s=1000, batch_slowdown=0.02)
    assert step_seconds(timing, 500, 10) == pytest.approx((0.5 + 0.01 * 1.2) / 2)


async def test_engine_stats_hold_modelled_and_real_step_seconds_and_queue_wait() -> None:
    # One slot, two 5-token requests: the second waits for the first's 5 steps. Lower bounds only:
    # a busy machine can make steps late, never early.
    timing = Timing(ttft=0.0, tpot=0.01, speed=1.0, prefill_tokens_per_s=1e9, batch_slowdown=0.0)
    engine = Engine(timing, EngineLimits(1, 10_000, 4))
    first, second = (engine.submit(text_prompt("abcd" * 10, 4), 5) for _ in range(2))
    await second.wait_done()
    stats = engine.stats
    assert first.finished and stats.admitted == 2 and stats.steps == 10
    assert stats.step_model_s == pytest.approx(10 * step_seconds(timing, 0, 1), rel=1e-3)  # prefill is free here
    assert stats.step_real_s >= stats.step_model_s - 0.01  # sleeps may end a timer tick early, not more
    assert stats.queue_wait_s >= 5 * 0.01 - 0.005  # the second waited out the first's 5 steps
    assert stats.latency_s >= stats.first_token_s + 2 * 4 * 0.01 - 0.01  # each decoded 4 more tokens after its first


async def test_a_cold_engine_runs_its_first_steps_slower() -> None:
    # --cold-steps 3 --cold-factor 4: the first 3 of 6 steps are modelled 4x as long, then warm.
    timing = Timing(ttft=0.0, tpot=0.01, speed=1.0, prefill_tokens_per_s=1e9, batch_slowdown=0.0, cold_steps=3, cold_factor=4.0)
    engine = Engine(timing, EngineLimits(1, 10_000, 4))
    await engine.submit(text_prompt("abcd" * 10, 4), 6).wait_done()
    assert engine.stats.steps == 6
    assert engine.stats.step_model_s == pytest.approx((3 * 4 + 3) * 0.01, rel=1e-3)
    assert engine.stats.step_real_s >= engine.stats.step_model_s - 0.01


def test_cold_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--port", "1", "--model", "m", "--cold-steps", "40", "--cold-factor", "4"]).cold_steps == 40
    with pytest.raises(SystemExit):
        parse_args(["--port", "1", "--model", "m", "--cold-steps", "-1", "--cold-factor", "0.5"])
    err = capsys.readouterr().err
    assert "--cold-steps" in err and "--cold-factor" in err


async def test_instant_engine_answers_without_a_task() -> None:
    engine = Engine(Timing(0, 0, 1, 1e4, 0.02), EngineLimits(4, 1000, 4))
    seq = engine.submit(text_prompt("abcd" * 10, 4), 5)
    assert seq.finished and seq.generated == 5 and engine._task is None
    assert engine.submit(text_prompt("abcd" * 10, 4), 1).cached_tokens == 8


def test_config_reports_every_bad_flag_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--port", "1", "--model", "m", "--speed", "0", "--max-batch-size", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--speed" in err and "--max-batch-size" in err
