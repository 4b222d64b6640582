"""The limit rules themselves (LocalLimiter: the in-memory store and Redis's fallback), on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import ApiKeyConfig, parse_config
from gateway.errors import Refusal
from gateway.filters.limits import estimate_prompt_tokens, max_tokens_of
from gateway.state.limits import Decision, LocalLimiter, rate_headers
from gateway.state.memory import MemoryStore

pytestmark = pytest.mark.unit

KEY = "sha256:" + "1" * 64


def _key(**limits) -> ApiKeyConfig:
    return ApiKeyConfig(name="k", hash=KEY, **limits)


def test_tpm_reserves_at_admission_and_settles_with_the_real_usage():
    now = [0.0]
    lim = LocalLimiter(clock=lambda: now[0])
    key = _key(rate_limit_tpm=1000)
    assert lim.admit(key, 600, "").ok
    d = lim.admit(key, 600, "")  # 400 left: a second reservation of 600 does not fit
    assert not d.ok and d.reason == "tpm" and d.retry_ms == 12_000  # 200 tokens at 1000/min
    lim.settle(key, 600, 100, "")  # it used 100: 500 come back
    assert lim.admit(key, 600, "").ok
    lim.settle(key, 600, 900, "")  # ran over its reservation: the extra is taken
    assert lim.admit(key, 1, "").tokens_left < 1000 - 100 - 900 + 1
    assert lim.admit(key, 1001, "").reason == "too_big"


def test_concurrency_leases_are_released_at_settle():
    lim = LocalLimiter(clock=lambda: 0.0)
    key = _key(max_concurrent=2)
    assert lim.admit(key, 0, "a").ok and lim.admit(key, 0, "b").ok
    assert lim.admit(key, 0, "c").reason == "concurrency"
    lim.settle(key, 0, 0, "a")
    assert lim.admit(key, 0, "c").ok


def test_budget_is_spent_per_period():
    lim = LocalLimiter(clock=lambda: 0.0)
    key = _key(budget_tokens=100, budget_period="total")
    assert lim.admit(key, 0, "").ok
    lim.settle(key, 0, 100, "")
    assert lim.admit(key, 0, "").reason == "budget"


def test_a_share_divides_every_limit():
    lim = LocalLimiter(clock=lambda: 0.0)
    key = _key(rate_limit_rpm=10)
    assert sum(lim.admit(key, 0, "", share=2).ok for _ in range(10)) == 5


def test_headers_are_in_openais_names_and_formats():
    key = _key(rate_limit_rpm=60, rate_limit_tpm=1000)
    h = dict(rate_headers(key, Decision(True, requests_left=59, tokens_left=500, requests_reset_ms=60_000)))
    assert h == {
        b"x-ratelimit-limit-requests": b"60", b"x-ratelimit-remaining-requests": b"59", b"x-ratelimit-reset-requests": b"1m0s",
        b"x-ratelimit-limit-tokens": b"1000", b"x-ratelimit-remaining-tokens": b"500", b"x-ratelimit-reset-tokens": b"30s",
    }
    assert rate_headers(_key(), Decision(True)) == []


@pytest.mark.parametrize("ms, text", [
    (-5, b"0ms"), (0, b"0ms"), (0.2, b"1ms"), (250, b"250ms"), (999.2, b"1000ms"), (1000, b"1s"), (1449, b"1.4s"),
    (1450, b"1.5s"), (1500, b"1.5s"), (59_949, b"59.9s"), (59_950, b"1m0s"), (60_000, b"1m0s"), (61_250, b"1m1.3s"),
    (360_000, b"6m0s"), (3_725_000, b"62m5s"),
])
def test_reset_durations_are_in_openais_format(ms, text):
    headers = dict(rate_headers(_key(rate_limit_rpm=1), Decision(True, requests_left=0, requests_reset_ms=ms)))
    assert headers[b"x-ratelimit-reset-requests"] == text
    assert dict(rate_headers(_key(rate_limit_rpm=1), Decision(True, requests_reset_ms=ms)))[b"x-ratelimit-reset-requests"] == text  # cached alike


def test_the_prompt_estimate_counts_text_of_every_shape():
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "x" * 400}]}) == 100 + 8 + 8
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 40}, {"type": "image_url", "image_url": {"url": "data:..."}}]}]}
    assert estimate_prompt_tokens(parts) == 10 + 16
    assert estimate_prompt_tokens({"prompt": "y" * 8}) == 2 + 8
    assert max_tokens_of({"max_completion_tokens": 7}) == 7 and max_tokens_of({"max_tokens": True}) is None


def test_the_memory_store_counts_usage_and_flags_estimates():
    cfg = parse_config({"auth": {"keys": [{"name": "k", "hash": KEY, "rate_limit_tpm": 10_000}]}, "backends": [{"url": "http://127.0.0.1:9"}]})
    store = MemoryStore(cfg)
    key = cfg.auth.keys[0]

    class Outcome:
        def __init__(self, p, c):
            self.ok, self.prompt_tokens, self.completion_tokens = True, p, c

    async def run():
        a = await store.admit(key, "m", 20, 100)
        assert not isinstance(a, Refusal) and a.reserved == 120
        store.settle(a, Outcome(15, 30))
        b = await store.admit(key, "m", 20, 100)
        store.settle(b, Outcome(None, 40))  # a stream without usage: the prompt is the estimate
        store.settle(b, Outcome(1, 1))  # settling twice counts once
        c = await store.admit(key, "m", 20, 100)
        store.settle(c, None)  # nothing was sent: not counted
        (row,) = await store.usage()
        assert (row.requests, row.prompt_tokens, row.completion_tokens, row.estimated) == (2, 35, 70, 1)

    asyncio.run(run())


def test_an_unlimited_key_is_estimated_only_when_the_response_reports_no_usage():
    from types import SimpleNamespace

    from gateway.state import stats

    store = MemoryStore(parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:1"}]}, env={}))
    calls = []

    def estimate() -> int:
        calls.append(1)
        return 42

    def prompt_tokens(name: str) -> float:
        return stats.USAGE_TOKENS.labels(key=name, model="m", kind="prompt").value

    with_usage = store.unlimited(ApiKeyConfig(name="lazy-a", hash=KEY), "m", estimate)
    store.settle(with_usage, SimpleNamespace(ok=True, prompt_tokens=7, completion_tokens=3))
    assert calls == [] and prompt_tokens("lazy-a") == 7  # the backend's usage: no body walk
    without = store.unlimited(ApiKeyConfig(name="lazy-b", hash=KEY), "m", estimate)
    store.settle(without, SimpleNamespace(ok=True, prompt_tokens=None, completion_tokens=None))
    assert calls == [1] and prompt_tokens("lazy-b") == 42


def test_in_memory_usage_is_kept_for_the_retention_and_no_longer():
    import time
    from types import SimpleNamespace

    from gateway.state.base import UsageRow, hour_of

    cfg = parse_config({"auth": {"disabled": True}, "backends": [{"url": "http://127.0.0.1:9"}], "state": {"usage_retention_days": 2}})
    store = MemoryStore(cfg)
    key = _key()
    now = hour_of(time.time())
    # Rows of earlier hours, as a long-running gateway holds them: one day and three days old.
    for age_days, n in ((1, 10), (3, 1000)):
        store._usage[(now - age_days * 86400, KEY, "m")] = UsageRow(KEY, "m", prompt_tokens=n, requests=1)
    store.settle(store.unlimited(key, "m", 0), SimpleNamespace(ok=True, prompt_tokens=5, completion_tokens=1))  # a new hour prunes

    async def read():
        return await store.usage(KEY), await store.usage(KEY, since=time.time() - 3600)

    (row,), (recent,) = asyncio.run(read())
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (2, 15, 1)  # the three-day-old row is gone
    assert (recent.requests, recent.prompt_tokens) == (1, 5)
