"""Backend discovery from DNS: a headless Service's A/AAAA records, re-resolved on an interval.

Each address becomes a backend ``{scheme}://{address}:{port}`` with the id ``{name}@{address}``
(origin ``discovered``), health-checked by the pool like any other. An address that leaves the
answer leaves the pool. A name that does not exist (NXDOMAIN, no records) is an empty set: every
pod is gone. A failed lookup (timeout, server failure) keeps the backends as they are: DNS
trouble must not empty the pool. The answer is untrusted: only IP literals are used, at most
``max_backends`` of them. The resolver is injectable; tests never touch the network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Awaitable, Callable

from ..config import DiscoverConfig
from .periodic import Periodic
from .pool import Backend, BackendPool

log = logging.getLogger("gateway.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]
LOOKUP_TIMEOUT = 5.0
_GONE = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)}


class NameGone(Exception):
    """The name has no records: not a failure, an empty set."""


async def system_resolver(name: str, port: int) -> list[str]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _GONE:
            raise NameGone(name) from None
        raise
    return [str(info[4][0]) for info in infos]


class DnsDiscovery:
    def __init__(self, config: DiscoverConfig, pool: BackendPool, resolver: Resolver = system_resolver,
                 on_removed: Callable[[str], None] | None = None):
        self.config = config
        self.pool = pool
        self.resolver = resolver
        self.on_removed = on_removed
        self.members: set[str] = set()  # backend ids this discovery added
        self._periodic = Periodic(f"discovery {config.dns}", self.refresh, lambda: self.config.interval, log)

    def _id(self, address: str) -> str:
        return f"{self.config.dns}@{address}"

    def _url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.config.scheme}://{host}:{self.config.port}"

    async def resolve(self) -> list[str] | None:
        """The addresses in the answer, or None when the lookup failed."""
        try:
            answer = await asyncio.wait_for(self.resolver(self.config.dns, self.config.port), LOOKUP_TIMEOUT)
        except NameGone:
            return []
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("discovery %s: lookup failed (%s); keeping %d backend(s)", self.config.dns, exc.__class__.__name__, len(self.members),
                        extra={"fields": {"event": "discovery_failed", "dns": self.config.dns, "error": exc.__class__.__name__}})
            return None
        addresses: list[str] = []
        for raw in answer:
            try:
                address = str(ipaddress.ip_address(raw))
            except ValueError:
                continue  # not an IP literal: never used as a URL host
            if address not in addresses:
                addresses.append(address)
        if len(addresses) > self.config.max_backends:
            log.warning("discovery %s: %d addresses, using the first %d (discover.max_backends)", self.config.dns, len(addresses), self.config.max_backends)
            addresses = sorted(addresses)[: self.config.max_backends]
        return addresses

    async def refresh(self) -> None:
        addresses = await self.resolve()
        if addresses is None:
            return
        wanted = {self._id(a): a for a in addresses}
        added: list[Backend] = []
        for backend_id, address in wanted.items():
            if backend_id in self.members:
                continue
            if self.pool.get(backend_id) is not None:  # taken by another origin: leave it alone
                continue
            c = self.config
            b = Backend(id=backend_id, url=self._url(address), api_key=c.api_key, models=frozenset(c.models or ()),
                        static_models=c.models is not None, origin="discovered")
            self.pool.add(b)
            self.members.add(backend_id)
            added.append(b)
        removed = sorted(self.members - set(wanted))
        for backend_id in removed:
            self.pool.remove(backend_id)
            self.members.discard(backend_id)
            if self.on_removed is not None:
                self.on_removed(backend_id)
        if added or removed:
            log.info("discovery %s: +%d -%d, %d backend(s)", self.config.dns, len(added), len(removed), len(self.members),
                     extra={"fields": {"event": "discovery_changed", "dns": self.config.dns, "added": [b.id for b in added],
                                       "removed": removed, "backends": len(self.members)}})
        if added:
            await self.pool.check_all(added)  # join the rotation now, not at the next health round

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
