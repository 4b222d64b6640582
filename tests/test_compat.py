"""gateway/_compat.py: one ``timeout`` for Python 3.10 (async-timeout) and 3.11+ (asyncio.timeout)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from gateway import _compat

pytestmark = pytest.mark.unit

BOTH = [pytest.param(_compat._from_async_timeout, id="async-timeout (3.10)"), pytest.param(_compat.timeout, id="chosen")]


def test_the_standard_one_is_used_where_there_is_one():
    if sys.version_info >= (3, 11):
        assert _compat.timeout is asyncio.timeout
    else:
        assert _compat.timeout is _compat._from_async_timeout


@pytest.mark.parametrize("timeout", BOTH)
async def test_a_passed_deadline_raises_the_builtin_timeout_error(timeout):
    never = asyncio.Event()
    with pytest.raises(TimeoutError) as caught:
        async with timeout(0.01):
            await never.wait()
    assert type(caught.value) is TimeoutError


@pytest.mark.parametrize("timeout", BOTH)
async def test_work_done_in_time_and_no_deadline_are_untouched(timeout):
    async with timeout(5):
        await asyncio.sleep(0)
    async with timeout(None):
        await asyncio.sleep(0)


@pytest.mark.parametrize("timeout", BOTH)
async def test_a_cancel_from_outside_stays_a_cancel(timeout):
    entered = asyncio.Event()

    async def waits() -> None:
        async with timeout(5):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.ensure_future(waits())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
