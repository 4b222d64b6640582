"""Processes of the routing bench: simulated backends and one gateway per policy, all on loopback.

Each is a subprocess in its own session; ``stop()`` ends that process group (SIGTERM, then
SIGKILL after a bounded wait). Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    def __init__(self, argv: list[str], what: str):
        self.what = what
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)

    def _wait(self, ok, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}: {err[-2000:]}")
            try:
                if ok():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"{self.what} not ready after {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()


class SimProc(_Proc):
    def __init__(self, model: str, speed: float, sim_argv: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.speed = speed
        super().__init__([sys.executable, "-m", "gateway.sim", "--port", str(self.port), "--model", model, *sim_argv], f"sim :{self.port}")
        self._wait(lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200, 30)

    def stats(self) -> dict:
        return httpx.get(self.url + "/_sim/stats", timeout=5).json()

    def control(self, **settings) -> None:
        httpx.post(self.url + "/_sim/control", json=settings, timeout=5).raise_for_status()


class GatewayProc(_Proc):
    def __init__(self, workdir: Path, policy: str, sims: list[SimProc], balancer: dict | None = None, keys: dict[str, tuple[str, str]] | None = None):
        """``keys``: name -> (secret, priority class); without, authentication is off."""
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
