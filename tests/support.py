"""Test harness: real servers on loopback sockets.

- ``Sim``: a simulated api_server in its own process (``python -m gateway.sim``).
- ``GatewayServer``: the gateway on its own HTTP server (gateway/server, what ``gateway serve``
  runs) in a background thread, from a config dict.
Both are context managers and stop what they started; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx

from gateway import server as http_server
from gateway.app import Gateway
from gateway.config import parse_config
from gateway.state.keys import hash_key, new_key
from gateway.launcher.guard import group_members
from gateway.sim.process import SimProcess, free_port

ROOT = Path(__file__).resolve().parent.parent


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


class Sim(SimProcess):
    """A simulated api_server subprocess on a free loopback port (``gateway.sim.process.SimProcess``)."""

    def __init__(self, model: str = "test-model", *args: str, api_key: str | None = None, host: str = "127.0.0.1", port: int | None = None, ready: bool = True):
        super().__init__(*args, model=model, api_key=api_key, host=host, port=port, ready=ready)

    @property
    def client(self) -> httpx.Client:
        return self.http

    @client.setter
    def client(self, value: httpx.Client) -> None:
        self.http = value


def launched_pids(launcher: Any) -> set[int]:
    """Every process of every launched instance: its guard and the guard's whole process group."""
    return {p for inst in launcher.instances if inst.pid for p in (inst.pid, *group_members(inst.pid))}


@contextlib.asynccontextmanager
async def launched(launcher: Any, stop_grace: float = 5.0, *, processes: bool = True) -> AsyncIterator[set[int]]:
    """Start a ``Launcher``; on the way out stop it and wait (bounded) until none of its processes is alive.

    Yields a set the test may add pids to (say, of an instance that later died); the processes
    still running at the end are added to it. ``processes=False``: the test may end with none.
    """
    pids: set[int] = set()
    await launcher.start()
    try:
        yield pids
    finally:
        pids |= launched_pids(launcher)
        await launcher.stop(stop_grace)
    assert pids or not processes, "the launcher ran no process: this test checks nothing"
    deadline = time.monotonic() + 5.0
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"pids {sorted(p for p in pids if alive(p))} outlived stop()"
        await asyncio.sleep(0.02)


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


@functools.lru_cache(maxsize=1)
def lmdeploy_python() -> str | None:
    """An interpreter that imports lmdeploy (its CLI and request models), or None:
    $LMDEPLOY_GATEWAY_TEST_LMDEPLOY_PYTHON, else the checkout's git-ignored .venv-lmdeploy/, else this one."""
    candidates = [os.environ.get("LMDEPLOY_GATEWAY_TEST_LMDEPLOY_PYTHON"), str(ROOT / ".venv-lmdeploy" / "bin" / "python"), sys.executable]
    for python in candidates:
        if not python or not os.path.exists(python):
            continue
        try:
            probe = subprocess.run([python, "-c", "import lmdeploy.cli.serve, lmdeploy.serve.openai.protocol"], capture_output=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return python
    return None
