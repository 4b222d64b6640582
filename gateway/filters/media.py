"""The media filter: every media item is base64 of an allowed type, or a URL on an allowed domain.

lmdeploy's api_server fetches whatever a media field names, ``file://`` and bare local paths
included (lmdeploy ``vl/media/connection.py::load_from_url``). This filter runs on the parsed body, after auth and
before routing, and a request it refuses never leaves the gateway. The rules live in
``gateway/media/`` (parsed once at config load); this module applies them to one request:

- ``check_body``: the walk (``media/walk.py``) over the body with the domain set in force (the
  key's ``media_allowed_domains`` when it has one, else the gateway's).
- ``check_body_async`` (``is_async`` says when the listener must await it): the walk, then either
  the DNS check (``resolve_dns``: every allowed host must resolve to public addresses only) or,
  with ``fetch: inline``, the fetch of every URL (``media/fetch.py``) and its replacement by the
  bytes as a base64 ``data:`` URL, so the backend never fetches anything.

Every refusal is a 400 whose ``reason`` (also the ``gateway_media_refusals_total`` label) is one
of ``REASONS``, whose ``param`` names the exact place, and whose message says why without
repeating the URL (only a host or a scheme that already passed the grammar is quoted).
"""

from __future__ import annotations

import asyncio
import base64

from ..config.media import MediaConfig
from ..errors import Refusal
from ..media.addresses import Resolver, getaddrinfo, is_global_address
from ..media.fetch import Budget, MediaFetcher
from ..media.reasons import MediaRefused
from ..media.url import DomainSet
from ..media.walk import Rules, Slot, Walk, text_only
from ..metrics import MEDIA_REFUSALS
from . import RequestContext

__all__ = ["MediaPolicy"]


class MediaPolicy:
    """Configured once from ``MediaConfig``; decides once per request."""

    def __init__(self, cfg: MediaConfig, *, resolver: Resolver | None = None, fetcher: MediaFetcher | None = None):
        self.cfg = cfg
        self.domains = cfg.domains
        self.rules = Rules(cfg)  # an unverifiable MIME type raises here, at start-up
        self.resolver = resolver or getaddrinfo
        self.inline = cfg.fetch == "inline"
        if self.inline and fetcher is None:
            fetcher = MediaFetcher(
                timeout=cfg.fetch_timeout,
                max_redirects=cfg.fetch_max_redirects,
                concurrency=cfg.fetch_concurrency,
                max_url_length=cfg.max_url_length,
                resolver=resolver,
            )
        self.fetcher = fetcher

    @property
    def is_async(self) -> bool:
        """True when the listener must ``await check_body_async`` (the DNS check or the inline fetch is on)."""
        return self.cfg.resolve_dns or self.inline

    def domains_for(self, ctx: RequestContext) -> DomainSet:
        key = ctx.key
        if key is not None and key.media_domains is not None:
            return key.media_domains
        return self.domains

    def check_body(self, ctx: RequestContext) -> Refusal | None:
        body = ctx.body
        if not body or text_only(ctx.route.kind, body):
            return None
        return self._walk(ctx, Walk(self.rules, self.domains_for(ctx)))

    async def check_body_async(self, ctx: RequestContext) -> Refusal | None:
        if not self.is_async:
            return self.check_body(ctx)
        body = ctx.body
        if not body or text_only(ctx.route.kind, body):
            return None
        if self.inline:
            slots: list[Slot] = []
            walk = Walk(self.rules, self.domains_for(ctx), slots=slots)
            return self._walk(ctx, walk) or (await self._fetch_all(walk, slots) if slots else None)
        hosts: list[tuple[str, int, str]] = []
        return self._walk(ctx, Walk(self.rules, self.domains_for(ctx), hosts=hosts)) or (await self._resolve_all(hosts) if hosts else None)

    def _walk(self, ctx: RequestContext, walk: Walk) -> Refusal | None:
        try:
            walk.body(ctx.route.kind, ctx.body)  # type: ignore[arg-type]
        except MediaRefused as exc:
            return self._refuse(exc)
        return None

    async def _resolve_all(self, hosts: list[tuple[str, int, str]]) -> Refusal | None:
        unique: dict[tuple[str, int], str] = {}
        for host, port, where in hosts:
            unique.setdefault((host, port), where)
        results = await asyncio.gather(
            *(asyncio.wait_for(self.resolver(h, p), self.cfg.dns_timeout) for h, p in unique), return_exceptions=True
        )
        for ((host, _), where), addrs in zip(unique.items(), results):
            if isinstance(addrs, BaseException) or not addrs:
                return self._refuse(MediaRefused("dns_failed", f"the host {host!r} could not be resolved", where))
            if not all(is_global_address(a) for a in addrs):
                return self._refuse(MediaRefused("dns_non_global", f"the host {host!r} resolves to an address that is not public", where))
        return None

    async def _fetch_all(self, walk: Walk, slots: list[Slot]) -> Refusal | None:
        """Fetch each distinct URL once, concurrently; the first failure cancels the rest."""
        assert self.fetcher is not None
        groups: dict[tuple[str, str], list[Slot]] = {}
        for s in slots:
            groups.setdefault((s.url.canonical, s.kind), []).append(s)
        budget = Budget(self.cfg.max_request_bytes - walk.total, self.cfg.max_request_bytes)

        async def one(group: list[Slot]) -> None:
            first = group[0]
            try:
                mime, content = await self.fetcher.fetch(  # type: ignore[union-attr]
                    first.url, first.kind, self.rules.mimes[first.kind], walk.domains, self.cfg.max_item_bytes, budget, copies=len(group)
                )
            except MediaRefused as exc:
                exc.param = first.where
                raise
            payload = base64.b64encode(content).decode("ascii")
            for s in group:
                s.fill(mime, payload)

        tasks = [asyncio.ensure_future(one(g)) for g in groups.values()]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:  # in body order, so the refusal names the first failing place
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if isinstance(exc, MediaRefused):
                    return self._refuse(exc)
                raise exc  # a bug, not a refusal: let the listener answer 500
        return None

    @staticmethod
    def _refuse(exc: MediaRefused) -> Refusal:
        MEDIA_REFUSALS.labels(reason=exc.reason).inc()
        param = exc.param or "body"
        return Refusal(400, f"Refused media at {param}: {exc.why}.", exc.reason, param=param)
