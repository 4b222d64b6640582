"""Policies by name: the names the config accepts and the classes behind them."""

from __future__ import annotations

from typing import Any

from ...config.balancer import POLICIES, BalancerConfig
from .base import Balancer
from .expected_latency import ExpectedLatencyBalancer
from .least_in_flight import LeastInFlight
from .least_load import LeastLoad
from .random_choice import RandomChoice
from .round_robin import RoundRobin

_POLICIES: dict[str, type[Balancer]] = {p.name: p for p in (ExpectedLatencyBalancer, LeastInFlight, RoundRobin, RandomChoice, LeastLoad)}
assert set(_POLICIES) == set(POLICIES), "config POLICIES and the policy classes disagree"


def make_balancer(policy: str, config: BalancerConfig | None = None, **kwargs: Any) -> Balancer:
    """The policy named ``policy``; ``config`` carries its knobs (the policy field of config is not read)."""
    try:
        cls = _POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown balancer policy {policy!r}; choose one of: {', '.join(POLICIES)}") from None
    return cls(config, **kwargs)
