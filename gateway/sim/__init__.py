"""A simulated ``lmdeploy serve api_server``: the same routes and shapes, no GPU.

It stands in for the real server in tests, in the launcher on machines without a GPU, and in
routing benchmarks: an asyncio continuous-batching engine (``engine.py``) gives realistic queueing,
batch slowdown and prefix-cache effects, and ``/_sim/*`` lets tests inspect every request that
reached it and inject faults. Run it with ``python -m gateway.sim --port P --model NAME``.
"""

from .app import build_app
from .config import SimConfig, parse_args

__all__ = ["SimConfig", "build_app", "parse_args"]
