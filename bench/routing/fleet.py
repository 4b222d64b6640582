"""Processes of the routing bench: simulated backends and one gateway per policy, all on loopback.

All are ``gateway.sim.process`` helpers, the ones the tests use: a subprocess in its own session
whose ``stop()`` ends the process group (SIGTERM, then SIGKILL after a bounded wait) and checks
that nothing of it is left. Every wait has a deadline.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import sys
from pathlib import Path

import httpx
import yaml

from gateway.sim.process import ROOT, LoopbackProcess, SimProcess, free_port


class _Proc(LoopbackProcess):
    """A gateway under test: ready when ``ok()`` holds, stopped (with the time to drain) if it never does."""

    def _wait(self, ok, timeout: float) -> None:
        try:
            self.wait_for(ok, timeout, "ready", interval=0.1)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 10.0) -> int:
        return super().stop(grace)


class SimProc(SimProcess):
    """One simulated backend of the fleet; ``speed`` names it in the gateway's backend list."""

    def __init__(self, model: str, speed: float, sim_argv: list[str]):
        self.speed = speed
        super().__init__(*sim_argv, model=model, ready_timeout=30)


class GatewayProc(_Proc):
    def __init__(self, workdir: Path, policy: str, sims: list[SimProc], balancer: dict | None = None, keys: dict[str, tuple[str, str]] | None = None,
                 state: dict | None = None):
        """``keys``: name -> (secret, priority class); without, authentication is off. ``state``: the
        ``state:`` section (``{"redis_url": ...}`` for replicas sharing load through Redis)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        auth: dict = {"disabled": True}
        if keys:
            auth = {"keys": [{"name": n, "hash": "sha256:" + hashlib.sha256(k.encode()).hexdigest(), "priority": p} for n, (k, p) in keys.items()]}
        config = {
            "auth": auth,
            "backends": [{"url": s.url, "name": f"sim{i}-x{s.speed:g}"} for i, s in enumerate(sims)],
            "health": {"interval": 1.0, "timeout": 2.0},
            "balancer": {"policy": policy, **(balancer or {})},
            "server": {"log_level": "warning"},
        }
        if state:
            config["state"] = state
        path = workdir / f"gateway-{policy}-{self.port}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.state_path = path.with_suffix(".state.json")
        super().__init__([sys.executable, "-m", "bench.routing.serve", str(path), str(self.port)], f"gateway ({policy})")
        n = len(sims)
        self._wait(lambda: httpx.get(self.url + "/ready", timeout=2).json().get("healthy_backends") == n, 30)


SMG = ROOT / ".venv-smg" / "bin" / "smg"


class SmgProc(_Proc):
    """The SGLang model gateway (``pip install smg`` into .venv-smg/) in front of the same sims."""

    def __init__(self, workdir: Path, policy: str, sims: list[SimProc], model: str):
        if not SMG.exists():
            raise FileNotFoundError(f"{SMG} is missing: python3 -m venv .venv-smg && .venv-smg/bin/pip install smg")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_path = workdir / f"smg-{self.port}.none"
        argv = [str(SMG), "launch", "--backend", "vllm", "--disable-tokenizer-autoload", "--policy", policy,
                "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--log-level", "error", "--worker-urls", *[s.url for s in sims]]
        super().__init__(argv, f"smg ({policy})")
        self._wait(lambda: any(m.get("id") == model for m in httpx.get(self.url + "/v1/models", timeout=2).json().get("data", [])), 60)


class RedisProc(_Proc):
    """A redis-server on a free loopback port for the replicas scenario: no persistence, no config file."""

    def __init__(self, workdir: Path):
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed: apt-get install -y redis-server")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        data = workdir / f"redis-{self.port}"
        data.mkdir()
        argv = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(data), "--protected-mode", "yes", "--loglevel", "warning"]
        super().__init__(argv, f"redis-server :{self.port}")
        self._wait(self.ping, 10)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False
