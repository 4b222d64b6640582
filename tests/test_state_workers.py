"""``gateway serve --workers N``: N processes on one port sharing Redis; one launches the backends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import yaml

from gateway.state.keys import hash_key, new_key
from support import ROOT, alive, free_port, wait_until
from test_launcher_gateway import descendants

pytestmark = pytest.mark.e2e


def _serve(cfg_path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg_path), *extra], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the supervisor (it stops its workers and their api_servers), SIGKILL to the group if it hangs."""
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    if proc.stderr:
        proc.stderr.close()


def _launching_config(path, keys, redis_url: str, port: int, prefix: str, extra_keys: list | None = None) -> None:  # type: ignore[no-untyped-def]
    """A gateway that launches one simulated api_server, with Redis state under ``prefix``."""
    path.write_text(yaml.safe_dump({
        "auth": {"keys": keys.entries + (extra_keys or [])},
        "launch": {"model": "sim-model", "model_name": "chat", "engine": "sim", "instances": 1, "health_interval": 0.2,
                   "sim": {"ttft": 0, "tpot": 0}},
        "health": {"interval": 0.2, "timeout": 1.0},
        "server": {"port": port},
        "state": {"redis_url": redis_url, "prefix": prefix},
    }))


def _chat(port: int, key: str) -> int:
    """One chat request on a fresh connection (the kernel spreads them over the workers); 0 if it failed."""
    try:
        with httpx.Client(timeout=10) as c:
            return c.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                          json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).status_code
    except httpx.HTTPError:
        return 0


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
    _launching_config(cfg, keys, redis_server.url, port, "w" + os.urandom(4).hex(),
                      [{"name": "limited", "hash": hash_key(limited), "rate_limit_rpm": 10}])
    proc = _serve(cfg, "--workers", "2")
    started: set[int] = set()
    try:
        def one(key: str) -> int:
            return _chat(port, key)

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
        _stop(proc)
    assert started
    wait_until(lambda: not any(alive(p) for p in started), 20, 0.1, "every worker and api_server gone")


def test_the_internal_key_reaches_the_workers_from_the_parent_and_never_redis(keys, redis_server, tmp_path, monkeypatch):
    import re

    import redis as redis_py

    monkeypatch.setenv("LMDEPLOY_GATEWAY_LOG_DIR", str(tmp_path / "logs"))
    port, prefix = free_port(), "k" + os.urandom(4).hex()
    cfg = tmp_path / "gw.yaml"
    _launching_config(cfg, keys, redis_server.url, port, prefix)
    proc = _serve(cfg, "--workers", "2")
    r = redis_py.Redis.from_url(redis_server.url, socket_timeout=5)
    try:
        def one() -> int:
            return _chat(port, keys.alice)

        wait_until(lambda: all(one() == 200 for _ in range(12)), 90, 0.3, "both workers serving the launched backend")
        assert [one() for _ in range(24)] == [200] * 24  # worker 1 calls worker 0's api_server with the parent's key

        # Everything under this gateway's prefix, keys and values (hashes field by field), as anyone with Redis access reads it.
        texts: list[bytes] = []
        for k in r.scan_iter(match=f"{prefix}:*", count=1000):
            texts.append(k)
            kind = r.type(k)
            if kind == b"hash":
                for f, v in r.hgetall(k).items():
                    texts += [f, v]
            elif kind == b"string":
                texts.append(r.get(k) or b"")
            elif kind == b"zset":
                texts += r.zrange(k, 0, -1)
            elif kind == b"list":
                texts += r.lrange(k, 0, -1)
        directory = r.hgetall(f"{prefix}:backends")
        assert directory, "the launched backend is published"
        urls = {json.loads(v)["url"] for v in directory.values()}
        assert all("api_key" not in json.loads(v) for v in directory.values())
        # The internal key is in no process's argv, so the test cannot read it: instead no string held in
        # Redis (nor any token in one) opens the launched api_server, which refuses a call without its key.
        candidates = {t for text in texts for t in [text, *re.findall(rb"[A-Za-z0-9_\-]{16,}", text)] if len(t) >= 16}
        with httpx.Client(timeout=5) as c:
            for url in urls:
                assert c.get(url + "/v1/models").status_code == 401
                opened = [t for t in candidates if c.get(url + "/v1/models", headers={"authorization": b"Bearer " + t}).status_code != 401]
                assert opened == []
    finally:
        r.close()
        _stop(proc)


def _cpus(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


def test_pin_workers_needs_several_workers(keys, redis_server, tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({"auth": {"keys": keys.entries}, "backends": [{"url": "http://127.0.0.1:9"}],
                                   "state": {"redis_url": redis_server.url}}))
    proc = _serve(cfg, "--pin-workers", "--port", str(free_port()))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and b"--pin-workers" in err and b"--workers N with N > 1" in err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 CPUs to tell workers apart")
def test_pinned_workers_run_on_one_cpu_each_and_their_api_servers_on_all(keys, redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("LMDEPLOY_GATEWAY_LOG_DIR", str(tmp_path / "logs"))
    port = free_port()
    cfg = tmp_path / "gw.yaml"
    _launching_config(cfg, keys, redis_server.url, port, "p" + os.urandom(4).hex())
    mine = sorted(_cpus(0))
    proc = _serve(cfg, "--workers", "2", "--pin-workers")
    started: set[int] = set()
    try:
        wait_until(lambda: _chat(port, keys.alice) == 200, 90, 0.3, "the pinned workers serving the launched backend")
        started = descendants(proc.pid)
        workers = sorted(p for p in started if b"--worker-index" in open(f"/proc/{p}/cmdline", "rb").read())
        assert len(workers) == 2
        assert [_cpus(p) for p in workers] == [{mine[0]}, {mine[1]}] or [_cpus(p) for p in workers] == [{mine[1]}, {mine[0]}]
        servers = [p for p in started if b"gateway.sim" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert servers and all(_cpus(p) == set(mine) for p in servers)  # the api_server is not on its launcher's one core
        assert _cpus(proc.pid) == set(mine)  # the supervisor is not pinned either
    finally:
        _stop(proc)
    wait_until(lambda: not any(alive(p) for p in started), 20, 0.1, "every worker and api_server gone")
