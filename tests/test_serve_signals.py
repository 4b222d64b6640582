"""`gateway serve` as an operator meets it: a busy port is reported before anything starts,
SIGHUP does not stop it silently, Ctrl-C exits 130, and a second Ctrl-C still stops the
launched backends without a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
import yaml

from support import ROOT, free_port, wait_until
from gateway.state.keys import hash_key

pytestmark = pytest.mark.e2e

LAUNCH = {"model": "sim-model", "model_name": "chat", "engine": "sim", "instances": 1, "health_interval": 0.2}


class Serve:
    def __init__(self, tmp_path, config: dict):
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        env = {**os.environ, "LMDEPLOY_GATEWAY_LOG_DIR": str(tmp_path / "logs")}
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def text(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float = 30) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(5)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
    except httpx.HTTPError:
        return False


def config(port: int) -> dict:
    return {"server": {"port": port}, "auth": {"keys": [{"name": "k", "hash": hash_key("k")}]}, "launch": LAUNCH}


def test_a_busy_port_is_reported_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        serve = Serve(tmp_path, config(port))
        try:
            assert serve.wait() == 1
        finally:
            serve.stop()
    text = serve.text()
    assert f"cannot listen on 127.0.0.1:{port}" in text and "already in use" in text
    assert "Started server process" not in text and "launch[0]" not in text and not (tmp_path / "logs").exists()


def test_sighup_is_logged_and_ctrl_c_twice_stops_backends_quietly_with_130(tmp_path):
    port = free_port()
    serve = Serve(tmp_path, config(port))
    try:
        wait_until(lambda: serve.proc.poll() is not None or ready(port), 30, 0.1, "ready")
        assert serve.proc.poll() is None, serve.text()
        serve.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP" in serve.text(), 10, 0.05, "the SIGHUP line")
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # still serving
        serve.proc.send_signal(signal.SIGINT)
        wait_until(lambda: "shutting down" in serve.text().lower(), 10, 0.005, "the first Ctrl-C to start the shutdown")
        serve.proc.send_signal(signal.SIGINT)  # the impatient second one: uvicorn forces its exit
        assert serve.wait() == 130
    finally:
        serve.stop()
    text = serve.text()
    assert "Traceback" not in text, text[-3000:]
    assert "-> stopped" in text  # the launched instance was stopped, not orphaned


def test_one_ctrl_c_drains_and_exits_130(tmp_path):
    port = free_port()
    serve = Serve(tmp_path, {**config(port), "launch": []} | {"backends": [{"url": "http://127.0.0.1:9", "models": ["m"]}]})
    try:
        wait_until(lambda: serve.proc.poll() is not None or "listening on http://" in serve.text(), 30, 0.05, "serving")
        serve.proc.send_signal(signal.SIGINT)
        assert serve.wait() == 130
    finally:
        serve.stop()
    assert "Traceback" not in serve.text()
