"""Launched backends behind the whole gateway: traffic through it, kill -9, SIGTERM and SIGKILL of `gateway serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from support import ROOT, GatewayServer, alive, free_port, gateway_config, wait_until

pytestmark = pytest.mark.e2e

LAUNCH = {"model": "sim-model", "model_name": "chat", "engine": "sim", "health_interval": 0.2, "restart_backoff": 0.05}


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(name)] = int(stat[stat.rfind(b")") + 2 :].split()[1])
    out: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - out
        out |= frontier
    return out


def chat(max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream}


@pytest.fixture
def log_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMDEPLOY_GATEWAY_LOG_DIR", str(tmp_path / "logs"))
    return tmp_path / "logs"


def test_the_gateway_keeps_answering_while_a_killed_instance_restarts_and_rejoins(keys, log_dir):
    config = gateway_config(keys, [], launch={**LAUNCH, "instances": 3, "sim": {"ttft": 0.01, "tpot": 0.002}}, health={"interval": 0.2, "timeout": 1.0})
    with GatewayServer(config, wait_healthy=False) as gw:
        launcher = gw.gateway.launcher
        wait_until(lambda: launcher.status()["healthy"] == 3, 20, 0.02, "3 healthy instances")
        pids = launched_pids(launcher)
        headers = {"authorization": f"Bearer {keys.alice}"}
        with httpx.Client(base_url=gw.url, headers=headers, timeout=20, trust_env=False) as http:
            assert http.get("/ready").json()["healthy_backends"] == 3
            results: list[int] = []
            stop = threading.Event()

            def traffic() -> None:
                with httpx.Client(base_url=gw.url, headers=headers, timeout=20, trust_env=False) as c:
                    while not stop.is_set():
                        results.append(c.post("/v1/chat/completions", json=chat()).status_code)

            workers = [threading.Thread(target=traffic) for _ in range(4)]
            for w in workers:
                w.start()
            try:
                wait_until(lambda: len(results) >= 12, 10, 0.01, "traffic flowing")
                victim = launcher.instances[1]
                server_pid = max(descendants(victim.pid))
                os.kill(server_pid, signal.SIGKILL)
                wait_until(lambda: victim.restarts == 1 and victim.state == "healthy", 15, 0.02, "the killed instance back")
                served_before = len(results)
                wait_until(lambda: len(results) >= served_before + 12, 10, 0.01, "traffic after the restart")
            finally:
                stop.set()
                for w in workers:
                    w.join(30)
            assert len(results) > served_before > 0
            assert set(results) == {200}, f"{len(results)} requests, statuses {sorted(set(results))}"
            assert http.get("/ready").json()["healthy_backends"] == 3, "the restarted instance is back in rotation"
            pids |= launched_pids(launcher)
    # Stopping the gateway stopped every backend it launched.
    wait_until(lambda: not any(alive(p) for p in pids), 10, 0.05, "launched processes to exit")


def launched_pids(launcher) -> set[int]:
    return {p for i in launcher.instances if i.pid for p in (i.pid, *descendants(i.pid))}


def serve(tmp_path: Path, keys, **launch) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "info"},
        "auth": {"keys": keys.entries},
        "launch": {**LAUNCH, **launch},
        "timeouts": {"drain": 15},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "LMDEPLOY_GATEWAY_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "gateway.err", "wb"),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited {proc.returncode}: {(tmp_path / 'gateway.err').read_text()[-3000:]}")
        try:
            return httpx.get(f"{url}/ready", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 30, 0.05, "gateway /ready")
    except TimeoutError:
        proc.kill()
        proc.wait(10)
        raise AssertionError((tmp_path / "gateway.err").read_text()[-5000:]) from None
    return proc, url


def test_sigterm_to_gateway_serve_drains_a_stream_to_its_end_then_stops_every_backend(tmp_path, keys):
    proc, url = serve(tmp_path, keys, instances=2, sim={"tpot": 0.03, "graceful_timeout": 10})
    try:
        wait_until(lambda: len(descendants(proc.pid)) >= 4, 10, 0.05, "2 guards and 2 api_servers")
        wait_until(lambda: httpx.get(f"{url}/ready", trust_env=False).json()["healthy_backends"] == 2, 10, 0.05, "2 healthy")
        pids = descendants(proc.pid)
        chunks: list[str] = []
        with httpx.Client(trust_env=False, timeout=30) as c:
            with c.stream("POST", f"{url}/v1/chat/completions", json=chat(max_tokens=40, stream=True), headers={"authorization": f"Bearer {keys.alice}"}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
                        if len(chunks) == 1:
                            os.kill(proc.pid, signal.SIGTERM)
        assert chunks[-1] == "[DONE]" and len(chunks) > 20, "the stream ran to its end"
        assert proc.wait(20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
        wait_until(lambda: not any(alive(p) for p in pids), 10, 0.05, "every backend process to exit")
        log = (tmp_path / "gateway.err").read_text()
        assert "engine sim, 2 instance(s)" in log
        assert "stopping 2 instance(s)" in log and "killed by" not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_sigkill_of_gateway_serve_leaves_no_backend_alive_and_the_next_start_works(tmp_path, keys):
    proc, url = serve(tmp_path, keys, instances=2)
    try:
        wait_until(lambda: httpx.get(f"{url}/ready", trust_env=False).json()["healthy_backends"] == 2, 10, 0.05, "2 healthy")
        pids = descendants(proc.pid)
        assert len(pids) >= 4
        proc.kill()  # only the gateway: its backends are in sessions of their own
        proc.wait(10)
        wait_until(lambda: not any(alive(p) for p in pids), 15, 0.05, f"orphans {sorted(p for p in pids if alive(p))} to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    proc, url = serve(tmp_path, keys, instances=1)
    try:
        wait_until(lambda: httpx.get(f"{url}/ready", trust_env=False).json()["healthy_backends"] == 1, 10, 0.05, "healthy again")
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {keys.alice}"}, trust_env=False, timeout=10)
        assert r.status_code == 200
        pids = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) in (0, -signal.SIGTERM)
        wait_until(lambda: not any(alive(p) for p in pids), 10, 0.05, "backends to exit")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
