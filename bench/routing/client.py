"""The open-loop load generator: sends each trace item at its time, whatever the earlier ones do."""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass

import aiohttp
import orjson

from .trace import Trace


@dataclass(slots=True)
class Result:
    index: int  # position in the trace
    ok: bool
    status: int
    latency: float  # send to last byte
    ttft: float | None  # send to first SSE frame (the first token)
    completion_tokens: int
    cached_tokens: int
    prompt_tokens: int
    shared: bool
    key: str = ""
    retry_after: bool = False  # a refusal carried Retry-After


async def _one(session: aiohttp.ClientSession, url: str, index: int, item, start: float, out: list[Result], secrets: dict[str, str]) -> None:
    loop = asyncio.get_running_loop()
    delay = start + item.at - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = loop.time()
    ttft = None
    usage: dict = {}
    status = 0
    ok = False
    retry_after = False
    headers = {"content-type": "application/json"}
    key = getattr(item, "key", "")
    if key:
        headers["authorization"] = f"Bearer {secrets[key]}"
    try:
        async with session.post(url, data=orjson.dumps(item.body), headers=headers) as resp:
            status = resp.status
            retry_after = "retry-after" in resp.headers
            tail = b""
            async for chunk in resp.content.iter_any():
                if ttft is None:
                    ttft = loop.time() - t0
                tail = (tail + chunk)[-2048:]
            ok = status == 200 and b"[DONE]" in tail
            i = tail.rfind(b'"usage"')
            if i >= 0:
                line = tail[tail.rfind(b"data:", 0, i) + 5 :].split(b"\n", 1)[0]
                try:
                    usage = orjson.loads(line).get("usage") or {}
                except orjson.JSONDecodeError:
                    usage = {}
    except (aiohttp.ClientError, asyncio.TimeoutError):
        ok = False
    details = usage.get("prompt_tokens_details") or {}
    out.append(
        Result(
            index=index,
            ok=ok,
            status=status,
            latency=loop.time() - t0,
            ttft=ttft,
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            shared=item.shared,
            key=key,
            retry_after=retry_after,
        )
    )


async def replay(url: str | list[str], trace: Trace, timeout: float, secrets: dict[str, str] | None = None) -> tuple[list[Result], float]:
    """(results, wall seconds from the first send to the last answer).

    ``url``: one gateway, or several replicas of one, taken in turn by request index (what a
    round-robin load balancer in front of them does).
    """
    urls = [url] if isinstance(url, str) else list(url)
    out: list[Result] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.2
        await asyncio.gather(*(_one(session, urls[i % len(urls)] + "/v1/chat/completions", i, it, start, out, secrets or {})
                               for i, it in enumerate(trace.items)))
        out.sort(key=lambda r: r.index)
        return out, loop.time() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, int(round(q / 100 * (len(values) - 1)))))
    return values[k]


def summarize(results: list[Result], wall: float, warmup: int) -> dict[str, float]:
    """Figures over the requests after the first ``warmup`` (the balancer's priors settle there)."""
    kept = results[warmup:] if len(results) > warmup else results
    ok = [r for r in kept if r.ok]
    refused = [r for r in kept if r.status in (429, 503)]
    lat = [r.latency for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tokens = sum(r.completion_tokens for r in results if r.ok)
    return {
        "n": len(kept),
        "errors": len(kept) - len(ok) - len(refused),
        "refused": len(refused),
        "refusal_p99": pct([r.latency for r in refused], 99) if refused else 0.0,
        "refusals_with_retry_after": sum(r.retry_after for r in refused),
        "throughput_rps": sum(1 for r in results if r.ok) / wall if wall > 0 else 0.0,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "lat_mean": statistics.fmean(lat) if lat else float("nan"),
        "lat_p50": pct(lat, 50),
        "lat_p99": pct(lat, 99),
        "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
    }
