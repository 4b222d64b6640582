"""The admin listener: its own port and key; backends with live figures; drain, undrain, add,
remove, restart; reload; metrics. None of it on the public port."""

from __future__ import annotations

import socket

import httpx
import pytest
import yaml

from gateway.config import ConfigError, parse_config
from gateway.state.keys import hash_key, new_key
from support import GatewayServer, Sim, free_port, gateway_config, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"
ADMIN_PATHS = [
    ("GET", "/status"), ("GET", "/admin/status"), ("GET", "/admin/backends"), ("POST", "/admin/backends"),
    ("DELETE", "/admin/backends/sim-0"), ("POST", "/admin/backends/sim-0/drain"), ("POST", "/admin/backends/sim-0/undrain"),
    ("POST", "/admin/backends/sim-0/restart"), ("POST", "/admin/reload"), ("GET", "/admin/balancer"),
]


class Env:
    def __init__(self, gw, sims, admin_key, config, path):
        self.gw, self.sims, self.admin_key, self.config, self.path = gw, sims, admin_key, config, path
        self.admin = httpx.Client(base_url=f"http://127.0.0.1:{gw.gateway.admin_server.port}", headers={"authorization": f"Bearer {admin_key}"}, timeout=20)

    def write_config(self, **changes) -> None:
        cfg = {**self.config, **changes}
        self.path.write_text(yaml.safe_dump(cfg), encoding="utf-8")


@pytest.fixture(scope="module")
def env(keys, tmp_path_factory):
    admin_key = new_key()
    sims = [Sim(MODEL, api_key="backend-secret") for _ in range(2)]
    try:
        backends = [{"url": s.url, "api_key": "backend-secret", "name": f"sim-{i}"} for i, s in enumerate(sims)]
        cfg = gateway_config(keys, backends, admin={"port": free_port(), "key_hash": hash_key(admin_key)})
        with GatewayServer(cfg) as gw:
            wait_until(lambda: all(b.healthy for b in gw.gateway.pool), 20, 0.02, "both sims healthy")
            path = tmp_path_factory.mktemp("admin") / "gateway.yaml"
            config = {**cfg, "server": {"host": "127.0.0.1", "port": gw.port}}
            gw.gateway.config_path = str(path)
            e = Env(gw, sims, admin_key, config, path)
            e.write_config()
            yield e
            e.admin.close()
    finally:
        for s in sims:
            s.stop()


def chat(env, key, n=1):
    with httpx.Client(base_url=env.gw.url, headers={"authorization": f"Bearer {key}"}, timeout=20) as c:
        return [c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) for _ in range(n)]


@pytest.mark.parametrize("method,path", ADMIN_PATHS)
def test_no_admin_path_is_reachable_on_the_public_port(env, keys, method, path):
    for auth in (None, keys.alice, env.admin_key):
        headers = {"authorization": f"Bearer {auth}"} if auth else {}
        r = httpx.request(method, env.gw.url + path, headers=headers, json={})
        assert r.status_code in (404, 405), (path, auth, r.status_code)
        assert "backends" not in r.text and "sim-0" not in r.text


def test_public_metrics_still_needs_an_admin_api_key_and_the_admin_key_is_not_an_api_key(env, keys):
    assert httpx.get(env.gw.url + "/metrics", headers={"authorization": f"Bearer {env.admin_key}"}).status_code == 401
    assert chat(env, env.admin_key)[0].status_code == 401


@pytest.mark.parametrize("method,path", ADMIN_PATHS[1:] + [("GET", "/metrics")])
def test_every_admin_route_needs_the_admin_key(env, keys, method, path):
    for headers in ({}, {"authorization": f"Bearer {keys.alice}"}, {"authorization": "Bearer wrong"}, {"authorization": env.admin_key}):
        r = httpx.request(method, str(env.admin.base_url) + path, headers=headers, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"


def test_the_admin_port_is_loopback_by_default():
    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1"}], "admin": {"key_hash": hash_key("k")}})
    assert cfg.admin.enabled and cfg.admin.host == "127.0.0.1" and cfg.admin.port == 8081


@pytest.mark.parametrize("admin,message", [
    ({"port": 9000}, "admin.key_hash: required: the admin listener needs its own key (`gateway admin-key` makes one)"),
    ({"key_hash": "sk-abc"}, "admin.key_hash: looks like a raw key; store its hash instead (`gateway keys hash` prints it)"),
    ({"key_hash": hash_key("k"), "prot": 1}, "admin.prot: unknown field (did you mean 'port'?); valid fields: host, key_hash, port"),
])
def test_admin_config_problems_are_named(admin, message):
    with pytest.raises(ConfigError) as exc:
        parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1"}], "admin": admin})
    assert exc.value.problems == [message]


def test_backends_are_listed_with_live_figures(env, keys):
    assert all(r.status_code == 200 for r in chat(env, keys.alice, 6))
    rows = {b["id"]: b for b in env.admin.get("/admin/backends").json()["backends"]}
    assert set(rows) >= {"sim-0", "sim-1"}
    for b in (rows["sim-0"], rows["sim-1"]):
        assert b["healthy"] and b["available"] and b["in_flight"] == 0 and b["origin"] == "static" and b["models"] == [MODEL]
    assert rows["sim-0"]["requests"] + rows["sim-1"]["requests"] >= 6
    served = [b for b in (rows["sim-0"], rows["sim-1"]) if b["requests"]]
    assert all(b["ttft_ms"] > 0 and b["tokens_per_s"] > 0 for b in served)
    status = env.admin.get("/admin/status").json()
    assert status["requests_total"] >= 6 and len(status["series"]["rate"]) == 60 and sum(status["series"]["rate"]) >= 6


def test_the_balancer_view_shows_what_was_learnt_per_backend(env, keys):
    assert all(r.status_code == 200 for r in chat(env, keys.alice, 4))
    view = env.admin.get("/admin/balancer").json()
    assert view["policy"] == "min_expected_latency" and view["gamma"] > 0 and view["picks"] >= 4
    per = view["backends"]
    assert set(per) >= {"sim-0", "sim-1"}
    for b in (per["sim-0"], per["sim-1"]):
        assert b["sigma"] > 0 and b["in_flight"] == 0 and set(b) == {"sigma", "slots", "slots_learnt_at", "kv_capacity", "in_flight", "external"}
    assert view["queue"] is None or all(set(q) == {"waiting", "rate", "wait_ratio"} for q in view["queue"].values())
    assert env.admin.post("/admin/balancer", json={}).status_code == 405
    assert "backend-secret" not in env.admin.get("/admin/balancer").text  # the backends' keys never show


def test_drain_takes_a_backend_out_of_rotation_and_undrain_brings_it_back(env, keys):
    r = env.admin.post("/admin/backends/sim-0/drain")
    assert r.status_code == 200 and r.json()["draining"] is True
    try:
        for s in env.sims:
            s.clear()
        assert all(r.status_code == 200 for r in chat(env, keys.alice, 6))
        assert len(env.sims[0].requests()) == 0 and len(env.sims[1].requests()) == 6
    finally:
        r = env.admin.post("/admin/backends/sim-0/undrain")
    assert r.status_code == 200 and r.json()["draining"] is False and r.json()["available"] is True


def test_add_and_remove_a_remote_backend(env, keys):
    with Sim("other-model", api_key="third-secret") as third:
        r = env.admin.post("/admin/backends", json={"url": third.url, "name": "third", "api_key": "third-secret"})
        assert r.status_code == 201, r.text
        assert r.json()["healthy"] is True and r.json()["models"] == ["other-model"] and r.json()["origin"] == "admin"
        with httpx.Client(base_url=env.gw.url, headers={"authorization": f"Bearer {keys.alice}"}) as c:
            ok = c.post("/v1/chat/completions", json={"model": "other-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert ok.status_code == 200
            assert env.admin.post("/admin/backends", json={"url": third.url}).status_code == 409
            assert env.admin.delete("/admin/backends/third").json() == {"removed": "third"}
            gone = c.post("/v1/chat/completions", json={"model": "other-model", "messages": [{"role": "user", "content": "hi"}]})
            assert gone.status_code == 404
        assert env.admin.delete("/admin/backends/third").status_code == 404


@pytest.mark.parametrize("body,message", [
    ({"url": "ftp://x"}, "'ftp://x' must start with http:// or https://"),
    ({"url": "http://127.0.0.1:1/v1"}, "must be a base URL with no path"),
    ({"url": "http://127.0.0.1:1", "colour": "red"}, "backend.colour: unknown field"),
    ({}, "backend.url: required field is missing"),
])
def test_a_bad_backend_is_refused_naming_the_field(env, body, message):
    r = env.admin.post("/admin/backends", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_restart_of_a_remote_backend_is_refused(env):
    r = env.admin.post("/admin/backends/sim-1/restart")
    assert r.status_code == 409 and r.json()["error"]["code"] == "backend_not_launched"
    assert env.admin.post("/admin/backends/nope/drain").status_code == 404


def test_reload_applies_live_fields_and_refuses_the_rest_naming_them(env, keys):
    late = new_key()
    assert chat(env, late)[0].status_code == 401
    entries = env.config["auth"]["keys"] + [{"name": "late", "hash": hash_key(late)}]
    env.write_config(auth={"keys": entries})
    r = env.admin.post("/admin/reload")
    assert r.status_code == 200 and r.json() == {"applied": ["auth"]}
    assert chat(env, late)[0].status_code == 200

    env.write_config(auth={"keys": entries}, server={"host": "127.0.0.1", "port": env.gw.port + 1}, timeouts={"connect": 1})
    r = env.admin.post("/admin/reload")
    assert r.status_code == 409 and r.json()["fields"] == ["server.port", "timeouts"]
    assert "server.port" in r.json()["error"]["message"]

    env.write_config(auth={"keys": entries}, limits={"max_body_bytes": "big"})
    r = env.admin.post("/admin/reload")
    assert r.status_code == 400 and "limits.max_body_bytes: expected an integer, got 'big'" in r.json()["error"]["message"]
    assert chat(env, late)[0].status_code == 200  # nothing of a refused reload was applied
    env.write_config()
    assert env.admin.post("/admin/reload").json() == {"applied": ["auth"]}
    assert chat(env, late)[0].status_code == 401


def test_metrics_on_the_admin_port(env):
    r = env.admin.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'gateway_backend_healthy{backend="sim-0"} 1.0' in r.text


def test_a_busy_admin_port_stops_the_start_naming_the_address(keys, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with Sim(MODEL) as sim:
            cfg = gateway_config(keys, [{"url": sim.url}], admin={"port": port, "key_hash": hash_key("k")})
            with pytest.raises(RuntimeError, match="failed to start"):
                GatewayServer(cfg)
    assert f"start-up failed: cannot listen on 127.0.0.1:{port}: Address already in use" in caplog.text


def test_restart_a_launched_instance(keys, tmp_path, monkeypatch):
    monkeypatch.setenv("LMDEPLOY_GATEWAY_LOG_DIR", str(tmp_path / "logs"))
    admin_key = new_key()
    launch = {"model": "sim-model", "model_name": "chat", "engine": "sim", "health_interval": 0.2, "restart_backoff": 0.05, "instances": 1}
    cfg = gateway_config(keys, [], launch=launch, admin={"port": free_port(), "key_hash": hash_key(admin_key)})
    with GatewayServer(cfg) as gw:
        launcher = gw.gateway.launcher
        wait_until(lambda: launcher.status()["healthy"] == 1, 20, 0.02, "the instance healthy")
        before = launcher.instances[0].pid
        with httpx.Client(base_url=f"http://127.0.0.1:{gw.gateway.admin_server.port}", headers={"authorization": f"Bearer {admin_key}"}) as admin:
            r = admin.post("/admin/backends/chat%230/restart")
            assert r.status_code == 202 and r.json() == {"restarting": "chat#0"}
            wait_until(lambda: launcher.instances[0].pid not in (None, before) and launcher.status()["healthy"] == 1, 20, 0.05, "a new healthy process")
            row = admin.get("/admin/backends").json()["backends"][0]
            assert row["id"] == "chat#0" and row["restarts"] == 1 and row["state"] == "healthy" and row["healthy"]
            assert admin.delete("/admin/backends/chat%230").status_code == 409


def test_reload_adds_and_removes_remote_backends_and_leaves_the_others(env, keys):
    with Sim("other-model", api_key="third-secret") as third:
        backends = [env.config["backends"][0], {"url": third.url, "api_key": "third-secret", "name": "third"}]
        env.write_config(backends=backends)
        try:
            r = env.admin.post("/admin/reload")
            assert r.status_code == 200 and r.json() == {"applied": ["backends"]}
            ids = {b.id for b in env.gw.gateway.pool}
            assert ids == {"sim-0", "third"}
            wait_until(lambda: env.gw.gateway.pool.get("third").healthy, 10, 0.02, "the new backend healthy")
            with httpx.Client(base_url=env.gw.url, headers={"authorization": f"Bearer {keys.alice}"}) as c:
                ok = c.post("/v1/chat/completions", json={"model": "other-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                assert ok.status_code == 200
        finally:
            env.write_config()
            assert env.admin.post("/admin/reload").json() == {"applied": ["backends"]}
    assert {b.id for b in env.gw.gateway.pool} == {"sim-0", "sim-1"}
    wait_until(lambda: all(b.healthy for b in env.gw.gateway.pool), 10, 0.02, "both sims healthy again")
