"""Processes of the routing bench: simulated backends and one gateway per policy, all on loopback.

Both are ``gateway.sim.process`` helpers, the ones the tests use: a subprocess in its own session
whose ``stop()`` ends the process group (SIGTERM, then SIGKILL after a bounded wait) and checks
nothing of it is left. Every wait has a deadline.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import yaml

from gateway.sim.process import LoopbackProcess, SimProcess, free_port


class SimProc(SimProcess):
    """One simulated backend of the fleet; ``speed`` names it in the bench's backend list."""

    def __init__(self, model: str, speed: float, sim_argv: list[str]):
        self.speed = speed
        super().__init__(*sim_argv, model=model, ready_timeout=30)


class GatewayProc(LoopbackProcess):
    def __init__(self, workdir: Path, policy: str, sims: list[SimProc], balancer: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "auth": {"disabled": True},
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
        try:
            self.wait_for(lambda: httpx.get(self.url + "/ready", timeout=2).json().get("healthy_backends") == n, 30, f"{n} healthy backends")
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 10.0) -> int:
        return super().stop(grace)  # a gateway drains what is in flight first
