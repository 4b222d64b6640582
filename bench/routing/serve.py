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
from gateway.routing.signals import Signals
from gateway.server import serve


class BenchGateway(Gateway):
    def __init__(self, config):
        super().__init__(config)
        self.state_path: Path | None = None
        self.started = time.monotonic()  # the balancer's clock: when its slots were learnt, from here

    def describe(self) -> dict:
        """The balancer's learnt state (``Gateway.learnt``, the admin listener's ``/admin/balancer``),
        in the bench's shape: per-field maps by backend, times from the gateway's start."""
        view = self.learnt()
        per = view.pop("backends", {})
        out: dict = dict(view)
        if per:
            for f in ("sigma", "kv_capacity", "slots"):
                out[f] = {i: b[f] for i, b in per.items()}
            # Seconds from the gateway's start (the trace starts a second or two later); None: not learnt.
            out["slots_learnt_at"] = {i: round(b["slots_learnt_at"] - self.started, 1) if b["slots_learnt_at"] else None for i, b in per.items()}
        out["signals"] = {i: repr(Signals(**sig)) for i, sig in view.get("signals", {}).items()}
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
