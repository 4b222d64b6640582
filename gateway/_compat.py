"""``timeout``: ``asyncio.timeout`` on Python 3.11+, the maintained ``async-timeout`` package on 3.10.

Both raise the builtin ``TimeoutError`` when the deadline passes (on 3.10 ``async-timeout`` raises
``asyncio.TimeoutError``, a different class there, so it is translated once, here).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import AsyncIterator


@contextlib.asynccontextmanager
async def _from_async_timeout(delay: float | None) -> AsyncIterator[None]:
    from async_timeout import timeout as async_timeout

    try:
        async with async_timeout(delay):
            yield
    except asyncio.TimeoutError:
        raise TimeoutError from None


if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - Python 3.10
    timeout = _from_async_timeout

__all__ = ["timeout"]
