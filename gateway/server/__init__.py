"""Our HTTP/1.1 server for the listener: every request bounded before the app sees it.

protocol.py     one connection: head limits, timeouts, no upgrades, lingering close, ASGI cycle
connections.py  the connection cap (idle ones make room, else 503), drain on shutdown
limits.py       the bounds, from ``server:`` and the open-files limit
serve.py        bind or take pre-bound sockets, lifespan, signals, ``run()``
"""

from .serve import PortBusy, Server, bind, new_loop, run

__all__ = ["PortBusy", "Server", "bind", "new_loop", "run"]
