"""The gateway process of the routing bench: ``python -m bench.routing.serve CONFIG.yaml PORT``.

The same wiring as ``gateway serve``, plus what the app may not wire yet: the balancer gets its
config section (``make_balancer(policy, config.balancer)``) and a ``MetricsScraper`` polls the
backends' /metrics every ``balancer.scrape_interval``. When the app already does either, this
adds nothing.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import httpx
import uvicorn

from gateway.app import Gateway
from gateway.config import load_config
from gateway.routing.balancer import make_balancer
from gateway.routing.signals import MetricsScraper


class BenchGateway(Gateway):
    def __init__(self, config):
        super().__init__(config)
        if getattr(self.balancer, "config", None) is not config.balancer:
            self.balancer = make_balancer(config.balancer.policy, config.balancer)
        self._own_scraper: MetricsScraper | None = None
        self._scrape_client: httpx.AsyncClient | None = None
        self.state_path: Path | None = None

    async def startup(self) -> None:
        await super().startup()
        interval = self.config.balancer.scrape_interval
        if interval > 0 and getattr(self, "scraper", None) is None:
            self._scrape_client = httpx.AsyncClient(timeout=2.0)
            self._own_scraper = MetricsScraper(lambda: self.pool, self.balancer.observe_signals, interval=interval, client=self._scrape_client)
            self._own_scraper.start()

    def describe(self) -> dict:
        """The balancer's learnt state, written next to the config when the run ends."""
        bal = self.balancer
        out: dict = {"policy": bal.name}
        if hasattr(bal, "gamma"):
            fleet = bal.fleet_sigma(list(self.pool))
            out.update(gamma=bal.gamma, rho=bal.rho, fleet_sigma=fleet, picks=bal.picks, affinity_picks=bal.affinity_picks)
            out["sigma"] = {b.id: bal.sigma(b, fleet) for b in self.pool}
            out["sizes"] = {m: {"fill": s.fill, "out_avg": s.out_avg, "token_ratio": s.token_ratio} for m, s in bal.sizes.items()}
        out["signals"] = {b.id: repr(b.stats.get("signals")) for b in self.pool}
        return out

    async def shutdown(self) -> None:
        if self.state_path is not None:
            self.state_path.write_text(json.dumps(self.describe(), indent=1, default=str))
        if self._own_scraper is not None:
            await self._own_scraper.stop()
        if self._scrape_client is not None:
            await self._scrape_client.aclose()
        await super().shutdown()


def main(argv: list[str]) -> int:
    config = load_config(argv[0])
    port = int(argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    gateway = BenchGateway(config)
    gateway.state_path = Path(argv[0]).with_suffix(".state.json")
    server = uvicorn.Server(
        uvicorn.Config(
            gateway.asgi(),
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            access_log=False,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
