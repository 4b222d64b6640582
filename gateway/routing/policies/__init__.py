"""Load balancing policies: one interface (``base``), one module per policy, selected by name (``factory``).

- ``min_expected_latency`` (default, ours): ``expected_latency.ExpectedLatencyBalancer``.
- ``least_in_flight``: fewest requests in flight through this gateway (LMDeploy proxy's effective policy).
- ``round_robin``, ``random``.
- ``least_load``: SGLang's formula on LMDeploy's scraped gauges.
"""

from .base import Balancer, Outcome, PerBackend, Prediction, RequestInfo, request_info
from .expected_latency import ExpectedLatencyBalancer
from .factory import make_balancer
from .least_in_flight import LeastInFlight
from .least_load import LeastLoad
from .random_choice import RandomChoice
from .round_robin import RoundRobin

__all__ = [
    "Balancer",
    "ExpectedLatencyBalancer",
    "LeastInFlight",
    "LeastLoad",
    "Outcome",
    "PerBackend",
    "Prediction",
    "RandomChoice",
    "RequestInfo",
    "RoundRobin",
    "make_balancer",
    "request_info",
]
