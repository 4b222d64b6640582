"""Test harness: real servers on loopback sockets.

- ``Sim``: a simulated api_server in its own process (``python -m gateway.sim``).
- ``GatewayServer``: the gateway on its own HTTP server (gateway/server, what ``gateway serve``
  runs) in a background thread, from a config dict.
Both are context managers and stop what they started; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from gateway import server as http_server
from gateway.app import Gateway
from gateway.config import parse_config
from gateway.filters.auth import hash_key, new_key

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class Sim:
    """A simulated api_server subprocess on a free loopback port."""

    def __init__(self, model: str = "test-model", *args: str, api_key: str | None = None, port: int | None = None, ready: bool = True):
        self.model = model
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        argv = [sys.executable, "-m", "gateway.sim", "--port", str(self.port), "--model", model, *args]
        if api_key:
            argv += ["--api-keys", api_key]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.client = httpx.Client(base_url=self.url, timeout=10.0)
        if ready:
            self.wait_ready()

    def wait_ready(self, timeout: float = 15.0) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"sim exited with {self.proc.returncode}: {err[-2000:]}")
            try:
                return self.client.get("/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout, 0.05, f"sim on port {self.port}")

    def requests(self) -> list[dict[str, Any]]:
        return self.client.get("/_sim/requests").json()

    def clear(self) -> None:
        self.client.delete("/_sim/requests")

    def control(self, **settings: Any) -> dict[str, Any]:
        r = self.client.post("/_sim/control", json=settings)
        r.raise_for_status()
        return r.json() if r.content else {}

    def stats(self) -> dict[str, Any]:
        return self.client.get("/_sim/stats").json()

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def __enter__(self) -> "Sim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class TestKeys:
    """API keys made fresh for a test session; only their hashes go into configs."""

    def __init__(self) -> None:
        self.alice = new_key()
        self.bob = new_key()  # restricted to one model
        self.entries = [
            {"name": "alice", "hash": hash_key(self.alice), "admin": True},
            {"name": "bob", "hash": hash_key(self.bob), "models": ["allowed-model"]},
        ]


class GatewayServer:
    """The gateway on our HTTP/1.1 server (uvloop) in a thread, on a free loopback port."""

    def __init__(self, config: dict[str, Any], *, wait_healthy: bool = True, **gateway_options: Any):
        config = dict(config)
        self.port = free_port()
        config.setdefault("server", {})
        config["server"] = {**config["server"], "host": "127.0.0.1", "port": self.port}
        self.config = parse_config(config, base_dir=ROOT)
        self.gateway = Gateway(self.config, **gateway_options)
        self.url = f"http://127.0.0.1:{self.port}"
        sock = http_server.bind("127.0.0.1", self.port)
        self.server = http_server.Server(self.gateway.asgi(), self.config.server, drain=self.config.timeouts.drain, sockets=[sock])
        self.result: list[int] = []
        self.thread = threading.Thread(target=self._run, name=f"gateway-{self.port}", daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), 30, 0.01, "gateway start")
        if not self.server.started:
            raise RuntimeError("gateway failed to start")
        if wait_healthy and len(self.gateway.pool):
            wait_until(lambda: any(b.healthy for b in self.gateway.pool), 30, 0.02, "a healthy backend")

    def _run(self) -> None:
        loop = http_server.new_loop()
        try:
            self.result.append(loop.run_until_complete(self.server.run(install_signals=False)))
        finally:
            loop.close()

    def stop(self) -> None:
        self.server.request_stop()
        self.thread.join(30)

    def __enter__(self) -> "GatewayServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def gateway_config(keys: TestKeys, backends: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "auth": {"keys": keys.entries},
        "backends": backends,
        "health": {"interval": 0.2, "timeout": 1.0},
    }
    cfg.update(sections)
    return cfg


@contextlib.contextmanager
def gateway_with_sims(keys: TestKeys, n: int = 1, model: str = "test-model", sim_args: tuple[str, ...] = (), **sections: Any) -> Iterator[tuple[GatewayServer, list[Sim]]]:
    sims: list[Sim] = []
    try:
        for _ in range(n):
            sims.append(Sim(model, *sim_args, api_key="backend-secret"))
        backends = [{"url": s.url, "api_key": "backend-secret", "name": f"sim-{i}"} for i, s in enumerate(sims)]
        with GatewayServer(gateway_config(keys, backends, **sections)) as gw:
            yield gw, sims
    finally:
        for s in sims:
            s.stop()
