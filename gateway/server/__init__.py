"""Our HTTP/1.1 server for the listener: every request bounded before the app sees it.

protocol.py     one connection: head limits, timeouts, no upgrades, lingering close, ASGI cycle
connections.py  the connection cap (idle ones make room, else 503), drain on shutdown
limits.py       the bounds, from ``server:`` and the open-files limit
serve.py        bind or take pre-bound sockets, lifespan, signals, ``run()``; ``start()`` serves a
                second app (an admin port) in a running loop with the same bounds
"""

from .serve import PortBusy, Server, Serving, bind, new_loop, run, start

__all__ = ["PortBusy", "Server", "Serving", "bind", "new_loop", "run", "start"]
