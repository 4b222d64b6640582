from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import TestKeys  # noqa: E402


@pytest.fixture(scope="session")
def keys() -> TestKeys:
    return TestKeys()


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session (tests isolate themselves with their own key prefix)."""
    from redisd import RedisServer

    server = RedisServer()
    try:
        yield server
    finally:
        server.close()
