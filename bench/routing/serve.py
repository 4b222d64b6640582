"""The gateway process of the routing bench: ``python -m bench.routing.serve CONFIG.yaml PORT``.

The same wiring as ``gateway serve``, on the same HTTP/1.1 server (gateway/server, not uvicorn: the
bench measures the gateway as it is deployed); when the run ends, the balancer's learnt state is
written next to the config (``CONFIG.state.json``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from gateway.app import Gateway
from gateway.config import load_config
from gateway.server import serve


class BenchGateway(Gateway):
    def __init__(self, config):
        super().__init__(config)
        self.state_path: Path | None = None
        self.started = time.monotonic()  # the balancer's clock: when its slots were learnt, from here

    def describe(self) -> dict:
        """The balancer's learnt state."""
        bal = self.balancer
        out: dict = {"policy": bal.name}
        if hasattr(bal, "gamma"):
            fleet = bal.fleet_sigma(list(self.pool))
            out.update(gamma=bal.gamma, rho=bal.rho, fleet_sigma=fleet, picks=bal.picks, affinity_picks=bal.affinity_picks)
            out["sigma"] = {b.id: bal.sigma(b, fleet) for b in self.pool}
            out["kv_capacity"] = {b.id: bal.models(b).kv_capacity for b in self.pool}
            out["slots"] = {b.id: bal.models(b).slots for b in self.pool}
            # Seconds from the gateway's start (the trace starts a second or two later); None: not learnt.
            out["slots_learnt_at"] = {b.id: round(bal.models(b).slots_at - self.started, 1) if bal.models(b).slots_at else None for b in self.pool}
            out["lag_vetoes"] = bal.lag_vetoes  # late first bytes set aside as the gateway's own lag
            out["sizes"] = {m: {"fill": s.fill, "out_avg": s.out_avg, "token_ratio": s.token_ratio} for m, s in bal.sizes.items()}
        if self.scraper is not None:
            out["signals"] = {i: repr(sig) for i, sig in self.scraper.signals.items()}
        return out

    async def shutdown(self) -> None:
        if self.state_path is not None:
            self.state_path.write_text(json.dumps(self.describe(), indent=1, default=str))
        await super().shutdown()


def main(argv: list[str]) -> int:
    config = load_config(argv[0])
    port = int(argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    gateway = BenchGateway(config)
    gateway.state_path = Path(argv[0]).with_suffix(".state.json")
    return serve.run(gateway.asgi(), config.server, drain=5.0, host="127.0.0.1", port=port)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
