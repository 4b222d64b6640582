"""Every control-plane read of a backend's answer is bounded (health, /metrics, /v1/models, /distserve/*)."""

from __future__ import annotations

import httpx
import pytest
import respx

from gateway.routing.disagg import MAX_CONTROL_BYTES, PDConnections, PDError
from gateway.routing.pd_policy import PDPicker
from gateway.routing.pool import Backend
from gateway.upstream import control_call

pytestmark = pytest.mark.unit

URL = "http://10.9.9.9:23333"


@respx.mock
async def test_a_control_answer_over_the_limit_is_not_kept_and_one_within_it_is():
    respx.get(f"{URL}/big").mock(return_value=httpx.Response(200, content=b"x" * 5000))
    respx.get(f"{URL}/small").mock(return_value=httpx.Response(200, content=b'{"ok": 1}'))
    async with httpx.AsyncClient() as client:
        assert await control_call(client, "GET", f"{URL}/big", limit=4096, timeout=1.0) == (200, None)
        assert await control_call(client, "GET", f"{URL}/small", limit=4096, timeout=1.0) == (200, b'{"ok": 1}')


@respx.mock
async def test_an_oversized_distserve_answer_fails_the_step():
    respx.get(f"{URL}/distserve/engine_info").mock(return_value=httpx.Response(200, content=b"[" + b"1," * MAX_CONTROL_BYTES + b"1]"))
    respx.post(f"{URL}/distserve/p2p_initialize").mock(return_value=httpx.Response(200, json={"status": 1}))
    async with httpx.AsyncClient() as client:
        conns = PDConnections(lambda: client, 1.0, PDPicker())
        backend = Backend(id="p", url=URL, api_key=None, models=frozenset({"m"}))
        with pytest.raises(PDError, match="answer too large"):
            await conns._call(backend, "GET", "/distserve/engine_info")
        assert await conns._call(backend, "POST", "/distserve/p2p_initialize", {"x": 1}) == {"status": 1}
