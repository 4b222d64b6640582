"""In-memory stand-ins for unit tests: no socket, no process.

- ``FakeUpstream``: the upstream client interface of ``gateway/upstream.py`` (``open``, ``read_all``,
  ``read_some``, the response's ``chunks``/``aclose``), answering each backend URL from a script.
  It subclasses ``Upstream``, so the real first-byte and idle deadlines and the body limits apply;
  only the transport (``_send``) is replaced.
- ``RecordingBalancer``: picks candidates in the order given and records every call the router
  makes, so a test can check that each dispatch is completed exactly once.
- ``Capture``: an ASGI ``send`` that keeps every message.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncIterator

from gateway.config import TimeoutsConfig, UpstreamConfig
from gateway.upstream import Upstream, UpstreamFailure, UpstreamInvalid, UpstreamResponse

SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


class Stall:
    """In a reply's chunks: wait here until the test calls ``release()`` (or a deadline fires)."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self._go = asyncio.Event()

    def release(self) -> None:
        self._go.set()

    async def wait(self) -> None:
        self.reached.set()
        await self._go.wait()


@dataclass
class Reply:
    """A response head, then its body: each item is bytes, a ``Stall``, or an exception to raise there."""

    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=lambda: list(JSON))
    chunks: list[Any] = field(default_factory=list)
    declared_length: int | None = None


@dataclass
class Fail:
    """No response: ``open`` raises this (``UpstreamFailure("connect_refused")``, ``UpstreamInvalid(...)``)."""

    error: Exception


@dataclass
class Hang:
    """The head never comes: ``open`` waits until the first-byte deadline."""

    reached: asyncio.Event = field(default_factory=asyncio.Event)


REFUSED = Fail(UpstreamFailure("connect_refused"))
RESET = Fail(UpstreamFailure("reset"))


def sse(*events: str) -> list[bytes]:
    """One chunk per ``data:`` event, as a backend streams them."""
    return [f"data: {e}\n\n".encode() for e in events]


@dataclass
class Call:
    url: str
    payload: bytes
    headers: list[tuple[bytes, bytes]]
    closed: bool = False  # aclose() was called on the response (or there was none)


class FakeUpstream(Upstream):
    """Answers ``base URL + path`` from ``script[base URL]``: one entry per request, in order.

    An entry is a ``Reply``, a ``Fail`` or a ``Hang``; a base URL whose entries are used up fails
    the test (an unexpected request).
    """

    def __init__(self, script: dict[str, list[Any]], timeouts: TimeoutsConfig | None = None, limits: UpstreamConfig | None = None):
        super().__init__(timeouts or TimeoutsConfig(connect=1.0, first_byte=5.0, idle=5.0), limits)
        self.script = {base: list(entries) for base, entries in script.items()}
        self.calls: list[Call] = []

    def backends_called(self) -> list[str]:
        return [next(b for b in self.script if c.url.startswith(b)) for c in self.calls]

    async def _send(self, url: str, payload: bytes, headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        call = Call(url, payload, list(headers), closed=True)
        self.calls.append(call)
        base = next((b for b in self.script if url.startswith(b + "/")), None)
        assert base is not None and self.script[base], f"unexpected request to {url}"
        entry = self.script[base].pop(0)
        if isinstance(entry, Fail):
            raise entry.error
        if isinstance(entry, Hang):
            entry.reached.set()
            await asyncio.Event().wait()  # the first-byte deadline in Upstream.open() ends this
        assert isinstance(entry, Reply), entry
        call.closed = False

        async def raw() -> AsyncIterator[bytes]:
            for item in entry.chunks:
                if isinstance(item, Stall):
                    await item.wait()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item

        async def close() -> None:
            call.closed = True

        return UpstreamResponse(
            entry.status, list(entry.headers), lambda: self._bounded(raw()), close, entry.declared_length, self.limits.max_line_bytes
        )

    async def aclose(self) -> None:
        pass


class RecordingBalancer:
    """The balancer interface the router uses; picks the first candidate, records each call in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []  # (what, backend id)
        self.outcomes: list[Any] = []

    def describe(self, model: str, body: dict[str, Any]) -> Any:
        return SimpleNamespace(model=model, body=body, prompt_tokens=0, max_tokens=None)

    def pick(self, candidates: list[Any], req: Any) -> Any:
        return candidates[0]

    def dispatched(self, backend: Any, req: Any) -> None:
        self.events.append(("dispatched", backend.id))

    def first_byte(self, backend: Any, req: Any, seconds: float) -> None:
        self.events.append(("first_byte", backend.id))

    def completed(self, backend: Any, req: Any, outcome: Any) -> None:
        self.events.append(("completed", backend.id))
        self.outcomes.append(outcome)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the router called RecordingBalancer.{name}, which the fake does not know: add it")


class Capture:
    """An ASGI ``send`` that keeps what it is given; ``fail_on`` makes the Nth body message raise (a client gone)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.fail_on = fail_on

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        bodies = sum(m["type"] == "http.response.body" for m in self.messages)
        if self.fail_on is not None and message["type"] == "http.response.body" and bodies == self.fail_on:
            raise OSError("client connection closed")

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.messages if m["type"] == "http.response.start"), None)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


__all__ = ["Call", "Capture", "Fail", "FakeUpstream", "Hang", "RecordingBalancer", "Reply", "REFUSED", "RESET", "SSE", "JSON", "Stall", "UpstreamInvalid", "sse"]
