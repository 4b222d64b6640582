"""``random``: a candidate at random."""

from __future__ import annotations

from typing import Sequence

from ..pool import Backend
from .base import Balancer, RequestInfo


class RandomChoice(Balancer):
    name = "random"

    def pick(self, candidates: Sequence[Backend], req: RequestInfo) -> Backend:
        return self.rng.choice(candidates)
