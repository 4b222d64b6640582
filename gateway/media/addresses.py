"""Which network addresses media may come from: public unicast only.

Used by the optional DNS check (``resolve_dns``) and by the inline fetcher, which connects to the
very address it checked (the connection is pinned, so a second DNS answer cannot move it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Awaitable, Callable

__all__ = ["AddressCheck", "Resolver", "getaddrinfo", "is_global_address"]

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> addresses as text
AddressCheck = Callable[[str], bool]

_NAT64 = ipaddress.ip_network("64:ff9b::/96")


async def getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def is_global_address(text: str) -> bool:
    """True only for a public unicast address; embedded IPv4 (mapped, 6to4, Teredo, NAT64) must be public too.

    Refused: private, loopback, link-local, multicast, reserved, unspecified, shared (100.64/10),
    documentation and benchmarking ranges, in IPv4 and IPv6.
    """
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
        if ip.teredo is not None:
            embedded += list(ip.teredo)
        if ip in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if any(not (a.is_global and not a.is_multicast) for a in embedded):
            return False
    return ip.is_global and not ip.is_multicast
