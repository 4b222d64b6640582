"""``round_robin``: the candidates in turn."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from ..pool import Backend
from .base import Balancer, RequestInfo


class RoundRobin(Balancer):
    name = "round_robin"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Backend], req: RequestInfo) -> Backend:
        return candidates[next(self._counter) % len(candidates)]
