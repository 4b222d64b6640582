"""``gateway usage`` for a gateway with the in-memory store: a real gateway process keeps usage per
key, model and hour, and the CLI reads it through the admin listener (GET /admin/usage)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from gateway.state.keys import hash_key, new_key
from support import ROOT, Sim, free_port, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_gateway_usage_reads_a_running_in_memory_gateway_through_its_admin_listener(keys, tmp_path):
    admin_key, other = new_key(), new_key()
    port, admin_port = free_port(), free_port()
    keys_file = tmp_path / "keys.yaml"
    created = _cli("keys", "create", "--name", "filed", "--file", str(keys_file))
    assert created.returncode == 0, created.stderr
    filed = next(line.strip() for line in created.stdout.splitlines() if line.strip().startswith("sk-"))
    with Sim(MODEL, "--ttft", "0", "--tpot", "0", api_key="backend-secret") as sim:
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(yaml.safe_dump({
            "server": {"host": "127.0.0.1", "port": port},
            "auth": {"keys": keys.entries + [{"name": "other", "hash": hash_key(other)}], "keys_file": str(keys_file)},
            "backends": [{"url": sim.url, "api_key": "backend-secret", "name": "sim-0"}],
            "admin": {"port": admin_port, "key_hash": hash_key(admin_key)},
        }))
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            def chat(key: str, i: int) -> int:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "count " + "y" * (5 * i + 1)}], "max_tokens": 2 + i}
                try:
                    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                      json=body, timeout=10).status_code
                except httpx.HTTPError:
                    return 0

            wait_until(lambda: chat(other, 0) == 200, 30, 0.1, "the gateway serving")
            start = sim.stats()
            assert [chat(filed, i) for i in range(5)] == [200] * 5
            end = sim.stats()
            assert chat(other, 1) == 200

            got = _cli("usage", "--config", str(cfg), "--key", "filed", "--since", "1h", "--json", env={"ADMIN_KEY": admin_key})
            assert got.returncode == 0, got.stderr
            rows = json.loads(got.stdout)
            assert [(r["key"], r["model"], r["requests"], r["estimated_requests"]) for r in rows] == [("filed", MODEL, 5, 0)]
            assert rows[0]["prompt_tokens"] == end["prompt_tokens"] - start["prompt_tokens"]
            assert rows[0]["completion_tokens"] == end["generation_tokens"] - start["generation_tokens"]

            everyone = _cli("usage", "--config", str(cfg), env={"ADMIN_KEY": admin_key})
            assert everyone.returncode == 0, everyone.stderr
            assert {line.split()[0] for line in everyone.stdout.splitlines()[1:]} == {"filed", "other"}

            wrong = _cli("usage", "--config", str(cfg), env={"ADMIN_KEY": new_key()})
            assert wrong.returncode == 1 and "answered 401" in wrong.stderr
            unset = _cli("usage", "--config", str(cfg), env={"ADMIN_KEY": ""})
            assert unset.returncode == 2 and "ADMIN_KEY" in unset.stderr

            admin = f"http://127.0.0.1:{admin_port}/admin/usage"
            bad = httpx.get(admin, params={"key": "filed"}, headers={"authorization": f"Bearer {admin_key}"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_usage_query"
            assert httpx.get(admin).status_code == 401
            assert httpx.get(admin, headers={"authorization": f"Bearer {other}"}).status_code == 401  # an API key is not the admin key
            auth = {"authorization": f"Bearer {admin_key}"}
            for query in ("since=nan", "since=-1", "since=1e300", "key=sha256:" + "A" * 64, "&".join(["since=1"] * 9)):
                refused = httpx.get(f"{admin}?{query}", headers=auth)  # bounded, refused in the OpenAI shape, never a 500
                assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_usage_query", query
            future = httpx.get(admin, params={"since": str(time.time() + 7200)}, headers={"authorization": f"Bearer {admin_key}"})
            assert future.status_code == 200 and future.json() == {"usage": []}
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
            if proc.stderr:
                proc.stderr.close()
        down = _cli("usage", "--config", str(cfg), env={"ADMIN_KEY": admin_key})
        assert down.returncode == 1 and "is the gateway running?" in down.stderr


def test_gateway_usage_without_redis_or_an_admin_section_says_what_it_needs(keys, tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({"auth": {"keys": keys.entries}, "backends": [{"url": "http://127.0.0.1:9"}]}))
    got = _cli("usage", "--config", str(cfg))
    assert got.returncode == 2
    assert "state.redis_url" in got.stderr and "admin:" in got.stderr
