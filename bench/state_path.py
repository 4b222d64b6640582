"""The limits path alone: admit + settle through a state store, CPU per request of this process and
of redis-server, without HTTP, wrk or a backend in the measurement.

On the shared 2-core machine the end-to-end rows of ``overhead.py`` move by tens of percent between
runs; this isolates the state layer (what ``gateway+memory`` / ``gateway+redis`` add), so two
versions can be compared run against run. Requests go ``--concurrency`` at a time, as the bench
key of ``overhead.py`` does (rpm, tpm and concurrency limits, never reached).

    python bench/state_path.py [--requests 20000] [--concurrency 32] [--store redis|memory]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import STATE_LIMITS, cpu_seconds, free_port, process, wait_port  # noqa: E402

MODEL = "bench-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello in one short sentence."}], "max_tokens": 16}


def scripts_run(port: int) -> tuple[int, int]:
    """Scripts Redis has run so far and the microseconds they took (INFO commandstats: EVALSHA/EVAL),
    the part of redis-server's CPU that does not depend on how the machine's syscalls are doing."""
    import redis

    with redis.Redis(port=port) as r:
        stats = r.info("commandstats")
    found = [v for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")]
    return sum(v.get("calls", 0) for v in found), sum(v.get("usec", 0) for v in found)


class _Outcome:
    ok = True
    prompt_tokens = 12
    completion_tokens = 16


class _Ctx:
    def __init__(self, key) -> None:  # type: ignore[no-untyped-def]
        self.key, self.model, self.body = key, MODEL, BODY


async def run(store_kind: str, redis_url: str | None, requests: int, concurrency: int, redis_pid: int | None, redis_port: int = 0) -> None:
    from gateway.config import parse_config
    from gateway.state.keys import hash_key, new_key
    from gateway.filters.limits import RateLimit
    from gateway.state import make_store

    state = {"redis_url": redis_url, "prefix": "sp" + secrets.token_hex(3)} if redis_url else None
    cfg = parse_config({"auth": {"keys": [{"name": "bench", "hash": hash_key(new_key()), **STATE_LIMITS}]},
                        "backends": [{"url": "http://127.0.0.1:9", "models": [MODEL]}], **({"state": state} if state else {})})
    store = make_store(cfg)
    await store.start()
    limits = RateLimit(store)
    ctx = _Ctx(store.keys.all()[0])
    outcome = _Outcome()

    async def client(n: int) -> None:
        for _ in range(n):
            adm = await limits.admit(ctx)
            await asyncio.sleep(0)  # the response: at least one turn of the loop
            limits.settle(adm, outcome)

    try:
        await asyncio.gather(*[client(max(1, requests // concurrency // 10)) for _ in range(concurrency)])  # warm-up
        per = requests // concurrency
        if hasattr(store, "flush"):
            await store.flush()
        scripts0 = scripts_run(redis_port) if redis_port else (0, 0)  # before the clocks start: a blocking call
        cpu0, rcpu0, t0 = time.process_time(), cpu_seconds(redis_pid) if redis_pid else 0.0, time.monotonic()
        await asyncio.gather(*[client(per) for _ in range(concurrency)])
        if hasattr(store, "flush"):
            await store.flush()
        n, wall = per * concurrency, time.monotonic() - t0
        line = f"{store_kind:6} c={concurrency:<3} {n / wall:8.0f} req/s  gateway cpu/req {(time.process_time() - cpu0) / n * 1e6:6.1f} us"
        if redis_pid:
            line += f"  redis-server cpu/req {(cpu_seconds(redis_pid) - rcpu0) / n * 1e6:6.1f} us"
        if redis_port:
            calls, usec = scripts_run(redis_port)
            line += f"  scripts/req {(calls - scripts0[0]) / n:5.2f} ({(usec - scripts0[1]) / n:4.1f} us in them)"
        print(line)
    finally:
        await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--store", choices=("redis", "memory"), default="redis")
    args = ap.parse_args()
    import uvloop

    if args.store == "memory":
        uvloop.run(run("memory", None, args.requests, args.concurrency, None))
        return
    port = free_port()
    with process(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]) as redis:
        wait_port(port)
        uvloop.run(run("redis", f"redis://127.0.0.1:{port}/0", args.requests, args.concurrency, redis.pid, port))


if __name__ == "__main__":
    main()
