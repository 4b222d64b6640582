"""``gateway serve --workers N``: N processes on one port sharing Redis; one launches the backends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
import yaml

from gateway.filters.auth import hash_key, new_key
from support import ROOT, alive, free_port, wait_until
from test_launcher_gateway import descendants

pytestmark = pytest.mark.e2e


def _serve(cfg_path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg_path), *extra], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def test_workers_with_the_in_memory_store_are_refused_with_a_clear_message(keys, tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({"auth": {"keys": keys.entries}, "backends": [{"url": "http://127.0.0.1:9"}]}))
    proc = _serve(cfg, "--workers", "2", "--port", str(free_port()))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert b"--workers 2 needs the shared state store" in err and b"state: {redis_url:" in err


def test_two_workers_share_one_port_one_launcher_and_the_limits(keys, redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("LMDEPLOY_GATEWAY_LOG_DIR", str(tmp_path / "logs"))
    limited = new_key()
    port = free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "auth": {"keys": keys.entries + [{"name": "limited", "hash": hash_key(limited), "rate_limit_rpm": 10}]},
        "launch": {"model": "sim-model", "model_name": "chat", "engine": "sim", "instances": 1, "health_interval": 0.2,
                   "sim": {"ttft": 0, "tpot": 0}},
        "health": {"interval": 0.2, "timeout": 1.0},
        "server": {"port": port},
        "state": {"redis_url": redis_server.url, "prefix": "w" + os.urandom(4).hex()},
    }))
    proc = _serve(cfg, "--workers", "2")
    started: set[int] = set()
    try:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

        def one(key: str) -> int:
            try:  # a fresh connection each time: the kernel spreads them over both workers
                with httpx.Client(timeout=10) as c:
                    return c.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json=body).status_code
            except httpx.HTTPError:
                return 0

        def both_ready() -> bool:
            return all(one(keys.alice) == 200 for _ in range(12))

        wait_until(both_ready, 90, 0.3, "both workers serving the launched backend")
        statuses = [one(keys.alice) for _ in range(24)]
        assert statuses == [200] * 24  # worker 1 learned the backend that worker 0 launched
        workers = [p for p in descendants(proc.pid) if b"--worker-index" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(workers) == 2
        servers = [p for p in descendants(proc.pid) if b"gateway.sim" in open(f"/proc/{p}/cmdline", "rb").read() or b"sim-model" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(servers) >= 1
        launched_by = {int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) for p in servers}
        assert len(launched_by & set(workers)) <= 1  # only one worker launches (and supervises) api_servers
        started = descendants(proc.pid)
        admitted = [one(limited) for _ in range(25)].count(200)
        assert admitted == 10  # one limit over both workers, not 10 per worker
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        if proc.stderr:
            proc.stderr.close()
    assert started
    wait_until(lambda: not any(alive(p) for p in started), 20, 0.1, "every worker and api_server gone")
