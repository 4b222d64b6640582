"""The Redis store: keys, limits, usage and load shared by every replica and worker.

- Keys live in one hash (``<p>:keys``, digest -> JSON record). Each process holds them all in
  its ``KeyCache``; a change is published on ``<p>:keys:changed`` and every subscriber re-reads
  that one key, so a created or revoked key takes effect everywhere within a second with no
  Redis round trip per request. A full reload runs every ``state.key_refresh`` seconds and after
  every reconnect, so a missed message cannot leave a key stale for long.
- Admission is one Lua script (``ADMIT``), one round trip: the rpm log, the tpm bucket, the concurrency
  lease set and the budget counter, all at Redis's clock. Settling (``SETTLE``: refund or charge
  tpm, drop the lease, count budget and usage) is batched: every few milliseconds one pipeline
  carries the settles of every request that ended meanwhile.
- Every call has a timeout (``state.timeout``). A failure marks Redis down for a second: known
  keys keep working from the cache, unknown keys are refused (the cache is the only source),
  limits fall back to ``LocalLimiter`` with each limit divided by the number of live replicas,
  ``gateway_state_degraded`` is 1 and a warning is logged. A heartbeat notices the recovery,
  reloads the keys and clears the flag.
- What is spent meanwhile is not lost: every settle, whether Redis or the fallback admitted the
  request, waits in a bounded queue (``max_pending``) and is applied when Redis is back: usage
  counters and the key's budget both. A queue that overflows drops its oldest settles, counts
  them (``gateway_state_settles_dropped_total``) and logs a warning.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import deque
from typing import Any, Awaitable, TypeVar

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError

from .._compat import timeout as _timeout
from ..config import ApiKeyConfig, ConfigError
from . import stats
from .base import HOUR, StateStore, UsageRow, hour_of
from .keys import key_from_record, key_to_record
from .limits import Admission, Decision, LocalLimiter, period_id, period_seconds_left
from .memory import merge_rows

log = logging.getLogger("gateway.state.redis")

T = TypeVar("T")

MAX_PENDING = 100_000  # settles waiting for Redis; beyond it the oldest usage is dropped (and counted)
DROP_WARN_EVERY = 10.0  # seconds between warnings about dropped settles (one per outage, then a reminder)
FLUSH_EVERY = 0.005  # seconds: how long settles gather before one pipeline carries them
DOWN_FOR = 1.0  # seconds a failure keeps requests on the local fallback before Redis is tried again

# KEYS: rpm bucket, tpm bucket, lease set, budget counter
# ARGV: rpm, tpm, max concurrent, tokens to reserve, lease id, lease ttl (ms), budget, request id
# rpm is a sliding log of the last minute's admissions (exact: never more than rpm in any 60 s);
# tpm is a token bucket, because its reservations are settled later.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local conc = tonumber(ARGV[3])
local reserve = tonumber(ARGV[4])
local ttl = tonumber(ARGV[6])
local budget = tonumber(ARGV[7])
local r = -1
local k = -1
local reset = 0
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
  r = rpm - redis.call('ZCARD', KEYS[1])
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if oldest[2] then reset = tonumber(oldest[2]) + 60000 - now end
end
if tpm > 0 then
  local v = redis.call('HMGET', KEYS[2], 'l', 't')
  k = tonumber(v[1])
  if not k then
    k = tpm
  else
    k = k + (now - tonumber(v[2])) * tpm / 60000
    if k > tpm then k = tpm end
  end
end
if budget > 0 then
  local used = tonumber(redis.call('GET', KEYS[4]) or '0')
  if used >= budget then return {0, 'budget', 0, tostring(r), tostring(k), reset} end
end
if rpm > 0 and r < 1 then
  return {0, 'rpm', reset, tostring(r), tostring(k), reset}
end
if tpm > 0 then
  if reserve > tpm then return {0, 'too_big', 0, tostring(r), tostring(k), reset} end
  if k < reserve then return {0, 'tpm', math.ceil((reserve - k) * 60000 / tpm), tostring(r), tostring(k), reset} end
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then return {0, 'concurrency', 1000, tostring(r), tostring(k), reset} end
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[5])
  redis.call('PEXPIRE', KEYS[3], ttl * 2)
end
if rpm > 0 then
  r = r - 1
  redis.call('ZADD', KEYS[1], now, ARGV[8])
  redis.call('PEXPIRE', KEYS[1], 61000)
  if reset == 0 then reset = 60000 end
end
if tpm > 0 then
  k = k - reserve
  redis.call('HSET', KEYS[2], 'l', tostring(k), 't', now)
  redis.call('PEXPIRE', KEYS[2], 120000)
end
return {1, '', 0, tostring(r), tostring(k), reset}
"""

# KEYS: tpm bucket, lease set, budget counter, usage hash of this hour
# ARGV: tpm, tokens to give back (negative: to take), lease id, tokens used, budget ttl (s, -1: no
#       budget, 0: forever), usage field prefix, prompt, completion, estimated (0/1), usage ttl (s), counted (0/1)
SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tpm = tonumber(ARGV[1])
local back = tonumber(ARGV[2])
if tpm > 0 and back ~= 0 then
  local v = redis.call('HMGET', KEYS[1], 'l', 't')
  local l = tonumber(v[1])
  if l then
    l = l + (now - tonumber(v[2])) * tpm / 60000
    if l > tpm then l = tpm end
    l = l + back
    if l > tpm then l = tpm end
    redis.call('HSET', KEYS[1], 'l', tostring(l), 't', now)
    redis.call('PEXPIRE', KEYS[1], 120000)
  end
end
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], ARGV[3]) end
local used = tonumber(ARGV[4])
local bttl = tonumber(ARGV[5])
if bttl >= 0 and used > 0 then
  redis.call('INCRBY', KEYS[3], used)
  if bttl > 0 then redis.call('EXPIRE', KEYS[3], bttl) end
end
if ARGV[11] == '1' then
  local f = ARGV[6]
  redis.call('HINCRBY', KEYS[4], f .. '|p', ARGV[7])
  redis.call('HINCRBY', KEYS[4], f .. '|c', ARGV[8])
  redis.call('HINCRBY', KEYS[4], f .. '|n', 1)
  if ARGV[9] == '1' then redis.call('HINCRBY', KEYS[4], f .. '|e', 1) end
  redis.call('EXPIRE', KEYS[4], tonumber(ARGV[10]))
end
return 1
"""

# KEYS: lease sets; ARGV[1]: ttl (ms), ARGV[2..]: the lease ids, one per key
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + ttl, ARGV[i + 1])
  redis.call('PEXPIRE', key, ttl * 2)
end
return #KEYS
"""


class RedisStore(StateStore):
    kind = "redis"
    shared = True

    def __init__(self, config, client: Any = None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config)
        cfg = self.cfg
        p = cfg.prefix
        self._p = p
        self.keys_hash = f"{p}:keys"
        self.channel = f"{p}:keys:changed"
        self.r = client or aioredis.from_url(
            cfg.redis_url,
            socket_timeout=cfg.timeout,
            socket_connect_timeout=cfg.timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            max_connections=256,
        )
        self._admit = self.r.register_script(ADMIT)
        self._settle_script = self.r.register_script(SETTLE)
        self._renew = self.r.register_script(RENEW)
        self.fallback = LocalLimiter()
        self.replicas = 1  # live replicas last seen; the fallback divides limits by it
        self._down_until = 0.0
        self.degraded = False
        self._pending: deque[tuple[list[str], list[Any]]] = deque()
        self.max_pending = MAX_PENDING
        self._dropped_warned = 0.0
        self._admits: list[tuple[list[str], list[Any], asyncio.Future[Any]]] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._leases: dict[str, tuple[str, str]] = {}  # lease id -> (lease set key, lease id) held by this process
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.synced = asyncio.Event()  # the first full key load is done
        self.load: dict[str, int] = {}  # backend id -> in-flight summed over the other replicas
        self.local_load: Any = None  # callable returning this replica's {backend id: in flight}
        self.on_load: Any = None  # called with the other replicas' summed {backend id: in flight}
        self.handlers: dict[str, Any] = {}  # extra pub/sub channel -> callable(data) (see cluster.py)

    # -- plumbing ------------------------------------------------------------------------------
    async def _call(self, op: str, aw: Awaitable[T]) -> T:
        try:
            # A deadline in this task, not wait_for (which runs ``aw`` in a task of its own on 3.11).
            async with _timeout(self.cfg.timeout * 2):
                return await aw
        except Exception:
            stats.STATE_ERRORS.labels(op=op).inc()
            self._mark_down(op)
            raise

    def _mark_down(self, op: str) -> None:
        self._down_until = time.monotonic() + DOWN_FOR
        if not self.degraded:
            self.degraded = True
            stats.STATE_DEGRADED.set(1)
            log.warning(
                "Redis is unreachable (%s failed): known keys keep working from the local cache, unknown keys are refused, "
                "limits fall back to a 1/%d share per replica until it is back",
                op, self.replicas,
            )

    def _mark_up(self) -> None:
        if self.degraded:
            self.degraded = False
            stats.STATE_DEGRADED.set(0)
            log.warning("Redis is reachable again: shared keys, limits and usage resume")

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            for script in (self._admit, self._settle_script, self._renew):
                script.sha = await self._call("script_load", self.r.script_load(script.script))
            await self._call("start", self.sync_keys())
            await self._heartbeat_once()
        except Exception as exc:
            log.warning("Redis not reachable at start-up (%s); serving the config's keys until it is", exc.__class__.__name__)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._subscribe()), loop.create_task(self._flusher()), loop.create_task(self._heartbeat())]

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except BaseException:
                pass
        try:
            await asyncio.wait_for(self._flush(), self.cfg.timeout * 4)
            await asyncio.wait_for(self.r.zrem(f"{self._p}:replicas", self.replica), self.cfg.timeout * 2)
        except Exception:
            pass
        if self._pending:
            log.warning("stopping with %d usage and budget settle(s) that Redis never received (it is unreachable)", len(self._pending))
        try:
            await self.r.aclose()
        except Exception:
            pass

    # -- keys ------------------------------------------------------------------------------------
    def _parse(self, digest: str, raw: bytes | str) -> ApiKeyConfig | None:
        try:
            return key_from_record(orjson.loads(raw), f"redis {self.keys_hash}[{digest[:15]}...]")
        except (ConfigError, orjson.JSONDecodeError, ValueError) as exc:
            log.error("ignoring a stored key that does not validate: %s", getattr(exc, "problems", exc))
            return None

    async def sync_keys(self) -> None:
        raw = await self.r.hgetall(self.keys_hash)
        keys = []
        for digest, value in raw.items():
            d = digest.decode() if isinstance(digest, bytes) else digest
            k = self._parse(d, value)
            if k is not None:
                keys.append(k)
        self.keys.set_store_keys(keys)
        stats.KEY_RELOADS.labels(source="redis", result="ok").inc()
        self.synced.set()

    async def _refresh_one(self, digest: str) -> None:
        raw = await self._call("key_refresh", self.r.hget(self.keys_hash, digest))
        self.keys.put_store_key(digest, self._parse(digest, raw) if raw is not None else None)

    async def put_key(self, key: ApiKeyConfig) -> None:
        record = orjson.dumps(key_to_record(key))
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys_hash, key.hash, record)
            pipe.publish(self.channel, key.hash)
            await self._call("put_key", pipe.execute())
        self.keys.put_store_key(key.hash, key)

    async def get_key(self, digest: str) -> ApiKeyConfig | None:
        raw = await self._call("get_key", self.r.hget(self.keys_hash, digest))
        return self._parse(digest, raw) if raw is not None else None

    async def list_keys(self) -> list[ApiKeyConfig]:
        raw = await self._call("list_keys", self.r.hgetall(self.keys_hash))
        out = []
        for d, v in raw.items():
            k = self._parse(d.decode() if isinstance(d, bytes) else d, v)
            if k is not None:
                out.append(k)
        return out

    async def _subscribe(self) -> None:
        backoff = 0.1
        last_full = time.monotonic()
        while not self._closing:
            pubsub = self.r.pubsub()
            try:
                await asyncio.wait_for(pubsub.subscribe(self.channel, *self.handlers), self.cfg.timeout * 2)
                # Subscribed first, then loaded: a change made in between is in the load or in a message.
                await self._call("sync_keys", self.sync_keys())
                backoff = 0.1
                while not self._closing:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                    if msg is not None and msg.get("type") == "message":
                        data = msg["data"]
                        ch = msg.get("channel")
                        ch = ch.decode() if isinstance(ch, bytes) else ch
                        if ch != self.channel:
                            handler = self.handlers.get(ch)
                            if handler is not None:
                                handler(data)
                            continue
                        digest = data.decode() if isinstance(data, bytes) else str(data)
                        if digest.startswith("sha256:") and len(digest) == 71:
                            await self._refresh_one(digest)
                        else:
                            await self._call("sync_keys", self.sync_keys())
                    if time.monotonic() - last_full > self.cfg.key_refresh:
                        last_full = time.monotonic()
                        await self._call("sync_keys", self.sync_keys())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._mark_down("subscribe")
                log.debug("key subscription lost: %s", exc.__class__.__name__)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            finally:
                try:
                    await asyncio.wait_for(pubsub.aclose(), self.cfg.timeout)
                except BaseException:
                    pass

    # -- limits ----------------------------------------------------------------------------------
    def _rk(self, key: ApiKeyConfig, kind: str) -> str:
        return f"{self._p}:rl:{key.hash[7:]}:{kind}"

    def _lease_key(self, key: ApiKeyConfig) -> str:
        return f"{self._p}:cc:{key.hash[7:]}"

    def _budget_key(self, key: ApiKeyConfig) -> str:
        return f"{self._p}:bud:{key.hash[7:]}:{period_id(key.budget_period)}"

    async def _decide(self, key: ApiKeyConfig, reserve: int, lease: str) -> tuple[Decision, bool, int]:
        if not self._down():
            keys = [self._rk(key, "r"), self._rk(key, "t"), self._lease_key(key), self._budget_key(key)]
            args = [key.rate_limit_rpm or 0, key.rate_limit_tpm or 0, key.max_concurrent or 0, reserve, lease,
                    int(self.cfg.lease_ttl * 1000), key.budget_tokens or 0, secrets.token_hex(8)]
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._admits.append((keys, args, fut))
            if len(self._admits) == 1:
                asyncio.get_running_loop().call_soon(self._send_admits)
            try:
                res = await fut
            except Exception:
                pass
            else:
                ok, reason, retry, r, k, reset = res
                d = Decision(bool(ok), reason.decode() if isinstance(reason, bytes) else reason, int(retry), float(r), float(k), int(reset))
                if d.ok and lease:
                    self._leases[lease] = (self._lease_key(key), lease)
                return d, True, 1
        share = max(1, self.replicas)
        return self.fallback.admit(key, reserve, lease, share), False, share

    async def _eval_many(self, op: str, calls: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        """Run scripts as one batch of EVALSHA commands on one connection: one write, one round
        trip. The commands are packed here (redis-py's general packer costs more than the rest of
        the request); a Redis that lost its scripts (restarted) gets them loaded and the batch
        re-run once. Results may hold per-call exceptions."""
        for attempt in (0, 1):
            buf: list[bytes] = []
            for script, keys, args in calls:
                items = [b"EVALSHA", script.sha.encode(), b"%d" % len(keys), *[k.encode() for k in keys], *[_arg(a) for a in args]]
                buf.append(b"*%d\r\n" % len(items))
                for item in items:
                    buf += (b"$%d\r\n" % len(item), item, b"\r\n")
            results = await self._call(op, self._send_raw(b"".join(buf), len(calls)))
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in results):
                for script in {id(c[0]): c[0] for c in calls}.values():
                    script.sha = await self._call("script_load", self.r.script_load(script.script))
                continue
            return results
        raise AssertionError("unreachable")

    async def _send_raw(self, packed: bytes, n: int) -> list[Any]:
        pool = self.r.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(packed, check_health=False)
            out: list[Any] = []
            for _ in range(n):
                try:
                    # No timeout context per reply (inf: none): the batch's deadline in _call bounds them all.
                    out.append(await conn.read_response(timeout=math.inf))
                except ResponseError as exc:  # an error reply to one command; the rest still follow
                    out.append(exc)
        except BaseException:
            await conn.disconnect()  # half read: it must not go back to the pool as it is
            raise
        finally:
            await pool.release(conn)
        return out

    def _send_admits(self) -> None:
        """Every admission asked for in this turn of the loop goes in one pipeline: one connection,
        one write, one read, however many requests arrived together (each still one round trip)."""
        batch, self._admits = self._admits, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run_admits(batch))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _run_admits(self, batch: list[tuple[list[str], list[Any], asyncio.Future[Any]]]) -> None:
        try:
            results = await self._eval_many("admit", [(self._admit, keys, args) for keys, args, _ in batch])
        except Exception as exc:
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, _, fut), res in zip(batch, results):
            if fut.done():
                continue
            if isinstance(res, Exception):
                stats.STATE_ERRORS.labels(op="admit").inc()
                fut.set_exception(res)
            else:
                fut.set_result(res)

    def _settle(self, adm: Admission, used: int, prompt: int, completion: int, estimated: bool, counted: bool) -> None:
        key = adm.key
        if adm.lease:
            self._leases.pop(adm.lease, None)
        shared = adm.shared
        if not shared and key.limited:
            self.fallback.settle(key, adm.reserved, used, adm.lease, max(1, self.replicas))
        if not shared and not counted:
            return
        now = time.time()
        # The budget is charged whoever admitted the request: one admitted by the fallback during an
        # outage is charged when its settle reaches Redis (a budget is never refunded, so late is exact).
        budget_ttl = period_seconds_left(key.budget_period, now) if key.budget_tokens else -1
        keys = [self._rk(key, "t"), self._lease_key(key), self._budget_key(key), f"{self._p}:usage:{hour_of(now)}"]
        args = [
            key.rate_limit_tpm or 0 if shared else 0,
            adm.reserved - used if shared else 0,
            adm.lease if shared else "",
            used,
            budget_ttl,
            f"{key.hash[7:]}|{adm.model}",
            prompt,
            completion,
            1 if estimated else 0,
            self.cfg.usage_retention_days * 86400,
            1 if counted else 0,
        ]
        if len(self._pending) >= self.max_pending:
            self._pending.popleft()
            self._dropped(1)
        self._pending.append((keys, args))
        self._wake.set()

    def _dropped(self, n: int) -> None:
        stats.SETTLES_DROPPED.inc(n)
        now = time.monotonic()
        if now - self._dropped_warned >= DROP_WARN_EVERY:
            self._dropped_warned = now
            log.warning(
                "Redis has been unreachable too long: %d settle(s) waiting, the most kept (state max_pending); the oldest usage "
                "and budget charges are dropped (gateway_state_settles_dropped_total counts them)",
                len(self._pending),
            )

    async def _flush(self) -> None:
        if not self._pending:
            return
        batch = list(self._pending)
        self._pending.clear()
        try:
            results = await self._eval_many("settle", [(self._settle_script, keys, args) for keys, args in batch])
        except Exception:
            # Kept for later (bounded): usage and budget are counted once Redis is back; leases expire on
            # their own. The batch goes back before what arrived meanwhile, so the oldest are the ones dropped.
            room = max(0, self.max_pending - len(self._pending))
            if room < len(batch):
                self._dropped(len(batch) - room)
            self._pending.extendleft(reversed(batch[len(batch) - room :]))
            raise
        failed = sum(1 for r in results if isinstance(r, Exception))
        if failed:
            stats.STATE_ERRORS.labels(op="settle").inc(failed)

    async def _flusher(self) -> None:
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(FLUSH_EVERY)  # let the settles of this moment gather into one pipeline
            if self._down():
                await asyncio.sleep(max(0.0, self._down_until - time.monotonic()))
            try:
                await self._flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._wake.set()
                await asyncio.sleep(0.2)

    async def flush(self) -> None:
        """Settle everything pending now (tests and shutdown)."""
        await self._flush()

    # -- heartbeat: replica count, lease renewal, load, recovery ------------------------------------
    async def _heartbeat_once(self) -> None:
        ttl_ms = int(self.cfg.lease_ttl * 1000)
        pipe = self.r.pipeline(transaction=False)
        replicas = f"{self._p}:replicas"
        wall = time.time()
        pipe.zadd(replicas, {self.replica: wall + self.cfg.lease_ttl})
        pipe.zremrangebyscore(replicas, "-inf", wall)
        pipe.zcard(replicas)
        if self._leases:
            held = list(self._leases.values())
            keys = [k for k, _ in held]
            pipe.evalsha(self._renew.sha, len(keys), *keys, ttl_ms, *[lid for _, lid in held])
        load_key = f"{self._p}:load:{self.replica}"
        local = self.local_load() if self.local_load is not None else {}
        if local:
            pipe.delete(load_key)
            pipe.hset(load_key, mapping=local)
            pipe.pexpire(load_key, ttl_ms)
        else:
            pipe.delete(load_key)
        pipe.zrange(replicas, 0, -1)
        res = await self._call("heartbeat", pipe.execute(raise_on_error=False))
        if any(isinstance(r, NoScriptError) for r in res):  # a restarted Redis: load the scripts again
            for script in (self._admit, self._settle_script, self._renew):
                script.sha = await self._call("script_load", self.r.script_load(script.script))
        errors = [r for r in res if isinstance(r, Exception) and not isinstance(r, NoScriptError)]
        if errors:
            stats.STATE_ERRORS.labels(op="heartbeat").inc()
            self._mark_down("heartbeat")
            raise errors[0]
        self.replicas = max(1, int(res[2]))
        others = [m.decode() if isinstance(m, bytes) else m for m in res[-1]]
        others = [m for m in others if m != self.replica]
        if self.local_load is not None and others:
            self.load = _sum_loads(await self._call("load", _hgetall_many(self.r, [f"{self._p}:load:{m}" for m in others])))
        else:
            self.load = {}
        if self.on_load is not None:
            self.on_load(self.load)
        was_degraded = self.degraded
        self._mark_up()
        if was_degraded:
            await self._call("sync_keys", self.sync_keys())
            self._wake.set()

    async def _heartbeat(self) -> None:
        while not self._closing:
            await asyncio.sleep(min(1.0, self.cfg.lease_ttl / 3))
            try:
                await self._heartbeat_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                pass

    async def exchange_load(self, publish: tuple[str, bytes] | None = None) -> None:
        """Publish this replica's in-flight counts and read the others' (more often than the heartbeat:
        a balancer that sees the others' requests a second late sends them all to the same backend).
        ``publish``: (channel, message) sent in the same round trip (the cluster's prefix placements);
        dropped while Redis is down."""
        if self.local_load is None or self._closing or self._down():
            return
        load_key = f"{self._p}:load:{self.replica}"
        local = self.local_load()
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(load_key)
        if local:
            pipe.hset(load_key, mapping=local)
            pipe.pexpire(load_key, int(self.cfg.lease_ttl * 1000))
        if publish is not None:
            pipe.publish(*publish)
        pipe.zrange(f"{self._p}:replicas", 0, -1)
        res = await self._call("load", pipe.execute())
        others = [m.decode() if isinstance(m, bytes) else m for m in res[-1]]
        others = [m for m in others if m != self.replica]
        total = _sum_loads(await self._call("load", _hgetall_many(self.r, [f"{self._p}:load:{m}" for m in others]))) if others else {}
        self.load = total
        if self.on_load is not None:
            self.on_load(total)

    def remote_in_flight(self, backend_id: str) -> int:
        return self.load.get(backend_id, 0)

    # -- usage -----------------------------------------------------------------------------------
    async def usage(self, key_hash: str | None = None, since: float | None = None) -> list[UsageRow]:
        now = time.time()
        first = hour_of(since if since is not None else now - self.cfg.usage_retention_days * 86400)
        hours = list(range(first, hour_of(now) + HOUR, HOUR))[-(self.cfg.usage_retention_days * 24 + 1) :]
        pipe = self.r.pipeline(transaction=False)
        for h in hours:
            pipe.hgetall(f"{self._p}:usage:{h}")
        results = await asyncio.wait_for(pipe.execute(), max(5.0, self.cfg.timeout * 10))
        rows: dict[tuple[str, str], UsageRow] = {}
        want = key_hash[7:] if key_hash else None
        for mapping in results:
            for field, value in mapping.items():
                f = field.decode() if isinstance(field, bytes) else field
                head, _, kind = f.rpartition("|")
                h, _, model = head.partition("|")
                if want is not None and h != want:
                    continue
                row = rows.get((h, model))
                if row is None:
                    row = rows[(h, model)] = UsageRow("sha256:" + h, model)
                n = int(value)
                if kind == "p":
                    row.prompt_tokens += n
                elif kind == "c":
                    row.completion_tokens += n
                elif kind == "n":
                    row.requests += n
                elif kind == "e":
                    row.estimated += n
        return merge_rows(rows.values())


MAX_LOAD_FIELDS = 4096  # per replica's entry: a few fields per backend; a larger hash is not one of ours
MAX_LOAD_VALUE = 10**12  # KV tokens or requests on one backend; bigger is not a real count


def _sum_loads(mappings: list[dict[Any, Any]]) -> dict[str, int]:
    """The other replicas' load entries summed per field. Redis content is not trusted: an entry with
    too many fields is skipped whole, a field or value that is not a short non-negative integer alone
    (its length checked before the parse), so one bad entry never stops the exchange."""
    total: dict[str, int] = {}
    for mapping in mappings:
        if not isinstance(mapping, dict) or len(mapping) > MAX_LOAD_FIELDS:
            continue
        for f, v in mapping.items():
            if not isinstance(v, (bytes, str)) or not 0 < len(v) <= 13 or len(f) > 1024:
                continue
            try:
                n = int(v)
                f = f.decode() if isinstance(f, bytes) else f
            except (ValueError, UnicodeDecodeError):
                continue
            if 0 <= n <= MAX_LOAD_VALUE:
                total[f] = total.get(f, 0) + n
    return total


async def _hgetall_many(r: Any, keys: list[str]) -> list[dict[Any, Any]]:
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.hgetall(k)
    return await pipe.execute()


def _arg(a: Any) -> bytes:
    if isinstance(a, bytes):
        return a
    if isinstance(a, int):
        return b"%d" % a
    return str(a).encode()
