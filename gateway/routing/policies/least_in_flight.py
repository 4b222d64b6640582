"""``least_in_flight``: fewest requests in flight through this gateway; ties at random.

This is what LMDeploy's proxy computes (``unfinished / speed`` with a speed nobody reports).
"""

from __future__ import annotations

from typing import Sequence

from ..pool import Backend
from .base import Balancer, RequestInfo


class LeastInFlight(Balancer):
    name = "least_in_flight"

    def pick(self, candidates: Sequence[Backend], req: RequestInfo) -> Backend:
        return self._least(candidates, lambda b: b.in_flight + b.remote_in_flight)  # summed over replicas
