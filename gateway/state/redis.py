"""The Redis store: keys, limits, usage and load shared by every replica and worker.

- Keys live in one hash (``<p>:keys``, digest -> JSON record). Each process holds them all in
  its ``KeyCache``; a change is published on ``<p>:keys:changed`` and every subscriber re-reads
  that one key, so a created or revoked key takes effect everywhere within a second with no
  Redis round trip per request. A full reload runs every ``state.key_refresh`` seconds and after
  every reconnect, so a missed message cannot leave a key stale for long.
- Admission is one Lua script (``ADMIT``), one round trip: the rpm log, the tpm bucket, the concurrency
  lease set and the budget counter, all at Redis's clock. The admissions asked for in one turn of
  the event loop go in one write on a lean pipelined connection (``resp.py``), those of one key in
  one ``ADMIT`` run that decides them in order (the script's fixed part, most of its cost, once for
  all of them). Settling (refund or
  charge tpm, drop the lease, count budget and usage) is batched: the settles of every request that
  ended meanwhile are folded into the next admission's ``ADMIT`` call, which runs them first (at most
  one script run per request, ``settle.py`` groups them), or go as one ``SETTLE_MANY`` call of their own
  after a few milliseconds when no admission comes.
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
import itertools
import logging
import math
import time
from collections import deque
from typing import Any, Awaitable, Iterable, TypeVar

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from .._compat import timeout as _timeout
from ..config import ApiKeyConfig, ConfigError
from . import stats
from .base import HOUR, StateStore, UsageRow, hour_of
from .grants import ASK_FIRST, GRANT_FRACTION, GRANT_MIN, SLOTS_FIRST, Ask, Grant
from .keys import key_from_record, key_to_record
from .limits import Admission, Decision, LocalLimiter, current_period_id, period_seconds_left
from .memory import merge_rows
from .resp import ReplyError, RespPipe, pack
from .settle import SETTLE_FN, SETTLE_MANY, STORE_TPM, Settle, settle_calls

log = logging.getLogger("gateway.state.redis")

# An admission waiting to be sent: its key's packed (keys, limits), its future, its packed
# (reservation, lease id), and the grant it asks for (None: none). The admissions of one key sent
# together share one ADMIT call (and the first ask among them).
_Admit = tuple[tuple[bytes, bytes], asyncio.Future[Any], bytes, "Ask | None"]
NO_ASK = b"$1\r\n0\r\n$1\r\n0\r\n$1\r\n0\r\n$0\r\n\r\n"  # ADMIT's ask arguments when none: 0 requests
_Call = tuple[list[bytes], list[Any], list[Settle]]  # a SETTLE_MANY call: keys, args, the settles it carries

T = TypeVar("T")

MAX_PENDING = 100_000  # settles waiting for Redis; beyond it the oldest usage is dropped (and counted)
DROP_WARN_EVERY = 10.0  # seconds between warnings about dropped settles (one per outage, then a reminder)
GROUP = 256  # admissions of one key in one ADMIT call at most: bounds its arguments, run time and unpack()
FLUSH_EVERY = 0.005  # seconds: the longest a settle that drops a lease waits for an admission write to ride on before it goes alone
# ... and one that only counts (usage, tokens back, budget): with grants few admissions go to Redis to
# carry settles, and each write of their own costs a syscall pair, a wake-up and a script run.
FLUSH_USAGE_EVERY = 0.025
DOWN_FOR = 1.0  # seconds a failure keeps requests on the local fallback before Redis is tried again

# KEYS: rpm log, tpm bucket, lease set, budget counter
# ARGV: rpm, tpm, max concurrent, lease ttl (ms), budget, grant life (ms) (the key's constants: the
# gateway packs them once per key, see _admit_head), n, a grant's ask (requests, tokens, slots, grant
# id; 0 requests: none, see grants.py), then n (tokens to reserve, lease id) pairs: the admissions of
# one key asked for in the same turn of the event loop, decided in order in one run (the trim, the
# reads and the writes once for all of them: Redis's CPU per admission is most of the script's fixed part).
# Returns 6 values per admission: ok, refusal reason, retry (ms), requests left, tokens left, reset (ms);
# then 7 for the grant: requests, tokens and slots granted (0 requests: none), requests and tokens left
# after it, reset (ms), and the time its rpm entries carry (ms).
# rpm is a sliding log of the last minute's admissions (exact: never more than rpm in any 60 s), kept
# as a list of their times, newest pushed at the head: they leave from the tail in the order they came,
# so expiring one is a pop (each entry popped once), the count is LLEN and the oldest is the tail, all
# O(1) (a sorted set of ~10^5 members cost a skiplist insert and a range delete per request). Redis's
# clock only moves forward in practice; if it stepped back, an entry would sit behind a newer one and
# leave late: the count errs on the safe side. tpm is a token bucket, because its reservations are
# settled later.
# Expiry without a PEXPIRE per request (each write command is ~1.3 us of Redis CPU):
# - the rpm log keeps one entry stored negated, the refresh point M: when it was marked the log's
#   expiry was set to M + 120 s (+ the grant life: a grant's entries are stamped up to that much
#   ahead). While M is in the window every entry is younger than M + 60 s (+ that), so the log
#   outlives its newest entry by 60 s; once M leaves the window (popped) the oldest entry left is
#   marked, or the next admission's if none is left, and the expiry set again: once a minute per key.
# - the tpm bucket stores its expiry ('e'): see STORE_TPM (settle.py), shared with SETTLE_MANY.
# Settles waiting when an admission is sent ride in its call, after its own keys and arguments
# (KEYS[5..], ARGV[12 + 2n..], as SETTLE_MANY takes them), and run first: at most one script run per
# request, and a lease or tokens given back count for these admissions already.
# A grant is made after the admissions, from what they left: at most 1/GRANT_FRACTION of each limit
# the key has, and only if that is at least GRANT_MIN requests' worth of each (2 slots of a
# concurrency cap) and less than half of a budget is spent. Its rpm entries are stamped at its end,
# so the log counts them until a minute after any of them can be used.
ADMIT = STORE_TPM + SETTLE_FN + f"""
local FRACTION, MIN = {GRANT_FRACTION}, {GRANT_MIN}
""" + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = tonumber(ARGV[7])
local s = 12 + 2 * n
if #ARGV >= s then settle_many(5, s, now) end
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local conc = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local budget = tonumber(ARGV[5])
local r = -1
local k = -1
local reset = 0
local mark = false -- the rpm log needs a new refresh point
local e = nil -- when the tpm bucket expires
if rpm > 0 then
  local expired = now - 60000
  local oldest = redis.call('LINDEX', KEYS[1], -1)
  while oldest do
    local at = tonumber(oldest)
    if at < 0 then at = -at end
    if at > expired then oldest = at break end
    if at ~= tonumber(oldest) then mark = true end
    redis.call('RPOP', KEYS[1])
    oldest = redis.call('LINDEX', KEYS[1], -1)
  end
  if oldest then
    if mark then -- the refresh point left the window: the oldest left becomes it
      redis.call('LSET', KEYS[1], -1, -oldest)
      redis.call('PEXPIRE', KEYS[1], 120000 + tonumber(ARGV[6]))
      mark = false
    end
  else
    mark = true -- an empty log: the first admission pushed now is the refresh point
  end
  r = rpm - redis.call('LLEN', KEYS[1])
  if oldest then reset = oldest + 60000 - now end
end
if tpm > 0 then
  local v = redis.call('HMGET', KEYS[2], 'l', 't', 'e')
  k = tonumber(v[1])
  e = tonumber(v[3])
  if not k then
    k = tpm
  else
    k = k + (now - tonumber(v[2])) * tpm / 60000
    if k > tpm then k = tpm end
  end
end
local spent = false
local half = true -- under half of the budget spent (or none): a grant may be made
if budget > 0 then
  local used = tonumber(redis.call('GET', KEYS[4]) or '0')
  spent = used >= budget
  half = used * 2 < budget
end
-- The n admissions in order, each by the same rules as if it came alone (the budget is charged at
-- settle, so it is the same for all of them); their writes go out once at the end.
local held = nil -- leases in the set, with this call's
local swept = false
local leases = {}
local pushes = 0
local taken = false -- tokens reserved from the tpm bucket
local out = {}
for i = 12, s - 1, 2 do
  local reserve = tonumber(ARGV[i])
  local why = nil
  local retry = 0
  if spent then
    why = 'budget'
  elseif rpm > 0 and r < 1 then
    why, retry = 'rpm', reset
  elseif tpm > 0 and reserve > tpm then
    why = 'too_big'
  elseif tpm > 0 and k < reserve then
    why, retry = 'tpm', math.ceil((reserve - k) * 60000 / tpm)
  elseif conc > 0 then
    if not held then held = redis.call('ZCARD', KEYS[3]) end
    -- expired leases (their replica died) are dropped only when they could make a difference: at the cap
    if held >= conc and not swept then
      redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
      held = redis.call('ZCARD', KEYS[3]) + #leases / 2
      swept = true
    end
    if held >= conc then why, retry = 'concurrency', 1000 end
  end
  if why then
    out[#out + 1] = 0
    out[#out + 1] = why
    out[#out + 1] = retry
  else
    if conc > 0 then
      held = held + 1
      leases[#leases + 1] = now + ttl
      leases[#leases + 1] = ARGV[i + 1]
    end
    if rpm > 0 then
      r = r - 1
      pushes = pushes + 1
      if reset == 0 then reset = 60000 end
    end
    if tpm > 0 then
      k = k - reserve
      taken = true
    end
    out[#out + 1] = 1
    out[#out + 1] = ''
    out[#out + 1] = 0
  end
  out[#out + 1] = tostring(r)
  out[#out + 1] = tostring(k)
  out[#out + 1] = reset
end
-- The grant, from what the admissions left (see above and grants.py).
local gr, gt, gc = 0, 0, 0
local gpush = 0
local stamp = now + tonumber(ARGV[6])
local ask = tonumber(ARGV[8])
if ask > 0 and half and not spent then
  local can = ask
  local per = 0 -- tokens a request, as asked
  if rpm > 0 then can = math.min(can, math.floor(r / FRACTION)) end
  if tpm > 0 then
    per = tonumber(ARGV[9]) / ask
    if per > 0 then can = math.min(can, math.floor(k / FRACTION / per)) end
  end
  local slots = 0
  if conc > 0 then
    if not held then held = redis.call('ZCARD', KEYS[3]) end
    slots = math.min(tonumber(ARGV[10]), math.floor((conc - held) / FRACTION))
  end
  if can >= MIN and (conc == 0 or slots >= 2) then
    gr = can
    if rpm > 0 then
      gpush = can
      r = r - can
      if reset == 0 then reset = 60000 end
    end
    if tpm > 0 then
      gt = math.floor(can * per)
      k = k - gt
      taken = true
    end
    if conc > 0 then
      gc = slots
      for j = 1, slots do
        leases[#leases + 1] = now + ttl
        leases[#leases + 1] = ARGV[11] .. '.' .. j
      end
    end
  end
end
out[#out + 1] = gr
out[#out + 1] = gt
out[#out + 1] = gc
out[#out + 1] = tostring(r)
out[#out + 1] = tostring(k)
out[#out + 1] = reset
out[#out + 1] = stamp
-- (in chunks: unpack() is bounded by Lua's C stack, and a grant pushes thousands)
if pushes + gpush > 0 then
  local at = {}
  for j = 1, pushes do at[j] = now end
  for j = pushes + 1, pushes + gpush do at[j] = stamp end
  if mark then at[1] = -at[1] end
  for c = 1, #at, 4000 do redis.call('LPUSH', KEYS[1], unpack(at, c, math.min(c + 3999, #at))) end
  if mark then redis.call('PEXPIRE', KEYS[1], 120000 + tonumber(ARGV[6])) end
end
if #leases > 0 then
  for c = 1, #leases, 4000 do redis.call('ZADD', KEYS[3], unpack(leases, c, math.min(c + 3999, #leases))) end
  redis.call('PEXPIRE', KEYS[3], ttl * 2)
end
if taken then store_tpm(KEYS[2], k, e, now) end
return out
"""

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


# The load exchange in one round trip on the hot-path pipe (it ran every state.load_interval as two
# redis-py pipelines, ~0.3 ms of CPU each time: most of an idle worker's CPU and a few us a request).
# KEYS: this replica's load entry, the replicas set; ARGV: ttl (ms), this replica, the load key prefix,
# then the entry's (field, value) pairs. Returns the other live replicas' entries, each flat.
# The others' entries are read by name from the replicas set (one Redis, as everywhere in this store).
LOAD_EXCHANGE = """
redis.call('DEL', KEYS[1])
if #ARGV > 3 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 4))
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
local out = {}
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if m ~= ARGV[2] then
    local v = redis.pcall('HGETALL', ARGV[3] .. m) -- not a hash (someone else's write): skipped, as a bad field is
    if v.err == nil then out[#out + 1] = v end
  end
end
return out
"""

RECANCEL_EVERY = 0.05  # seconds between cancellations of a task that lost one (stop_tasks)


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], timeout: float) -> set[asyncio.Task[Any]]:
    """Cancel tasks and wait for them, at most ``timeout``; the ones still running are returned.
    A cancellation can be lost (on 3.11 a timeout that expires at the same moment turns it into a
    TimeoutError, which a retrying loop then catches): it is sent again until the task ends. The
    caller's own cancellation is not swallowed (shutdown must stay stoppable), and the tasks'
    exceptions are retrieved (each was logged where it happened)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        done, pending = await asyncio.wait(pending, timeout=min(left, RECANCEL_EVERY))
        for t in done:
            if not t.cancelled():
                t.exception()
    return pending


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
            # One immediate retry on a dropped connection only: after a Redis restart every pooled
            # connection is stale and fails at once; a timeout is never retried (the call's bound holds).
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            retry_on_timeout=False,
            health_check_interval=0,
            max_connections=256,
        )
        # The hot path's scripts (admit, settle) go over their own lean pipelined connection (resp.py).
        self.pipe = RespPipe(cfg.redis_url, cfg.timeout * 2)
        self._key_names: dict[str, tuple[bytes, bytes, bytes, str]] = {}
        self._usage_keys: dict[int, bytes] = {}  # this hour's usage hash name
        self._lease_ttl_ms = int(cfg.lease_ttl * 1000)
        # A replica's load entry lives 50 exchanges (at least 1 s), not a lease's ttl: one that stopped
        # exchanging (stopped, stalled, paused) would otherwise keep its last in-flight counts on every
        # other replica's books for lease_ttl (30 s) after the backends finished those requests.
        self._load_ttl_ms = int(min(cfg.lease_ttl, max(1.0, 50 * cfg.load_interval)) * 1000)
        self._admit = self.r.register_script(ADMIT)
        self._settle_many = self.r.register_script(SETTLE_MANY)
        self._renew = self.r.register_script(RENEW)
        self._exchange_script = self.r.register_script(LOAD_EXCHANGE)
        self.fallback = LocalLimiter()
        self.replicas = 1  # live replicas last seen; the fallback divides limits by it
        self._down_until = 0.0
        self.degraded = False
        self._pending: deque[Settle] = deque()
        # The loop, kept: on 3.11 asyncio.get_running_loop() is a getpid() syscall each call (fork check).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending_since = 0.0  # when the oldest settle waiting (if any) arrived (time.monotonic)
        self._lease_since = 0.0  # ... the oldest that drops a lease (0: none waits)
        self.flush_every = FLUSH_EVERY
        self.flush_usage_every = FLUSH_USAGE_EVERY
        self.max_pending = MAX_PENDING
        self._dropped_warned = 0.0
        self._admits: list[_Admit] = []
        self._admit_heads: dict[str, tuple[ApiKeyConfig, str, tuple[bytes, bytes]]] = {}  # key hash -> (key, budget period, its packed keys and limits)
        self._inflight: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._leases: dict[str, tuple[str, str]] = {}  # lease id -> (lease set key, lease id) held by this process
        self._tasks: list[asyncio.Task[None]] = []
        self._pubsub: Any = None  # the subscriber's, closed under it at shutdown if it ignores its cancellation
        self._closing = False
        self.synced = asyncio.Event()  # the first full key load is done
        self.load: dict[str, int] = {}  # backend id -> in-flight summed over the other replicas
        self.load_sent = False  # the last exchange wrote a non-empty entry (requests of ours in flight)
        self.local_load: Any = None  # callable returning this replica's {backend id: in flight}
        self.on_load: Any = None  # called with the other replicas' summed {backend id: in flight}
        self.handlers: dict[str, Any] = {}  # extra pub/sub channel -> callable(data) (see cluster.py)
        # Grants (grants.py): the live one per key hash, the next ask's (requests, slots) per key, and
        # when each key's ask in flight went (one at a time per key).
        self._grant_life = cfg.grant_seconds
        self._grants: dict[str, Grant] = {}
        self._next_ask: dict[str, tuple[int, int]] = {}
        self._asking: dict[str, float] = {}
        self._grant_ids = itertools.count()

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
            await self._load_scripts()
            await self._call("start", self.sync_keys())
            await self._heartbeat_once()
        except Exception as exc:
            log.warning("Redis not reachable at start-up (%s); serving the config's keys until it is", exc.__class__.__name__)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._subscribe()), loop.create_task(self._flusher()), loop.create_task(self._heartbeat())]

    async def close(self) -> None:
        self._closing = True
        self.end_grants()
        self._wake.set()
        pending = await stop_tasks(self._tasks, self.cfg.timeout * 2)
        if pending:
            # redis-py can lose a cancellation in a pub/sub read, which then waits for a message that
            # may never come: closed under it, the read fails and the subscriber ends.
            ps = self._pubsub
            if ps is not None and ps.connection is not None:
                await ps.connection.disconnect(nowait=True)
            pending = await stop_tasks(pending, self.cfg.timeout * 2)
            if pending:
                log.error("%d Redis task(s) did not stop at shutdown: %s", len(pending), pending)
        try:
            await asyncio.wait_for(self._flush(), self.cfg.timeout * 4)
            await asyncio.wait_for(self.r.zrem(f"{self._p}:replicas", self.replica), self.cfg.timeout * 2)
        except Exception:
            pass
        if self._pending:
            log.warning("stopping with %d usage and budget settle(s) that Redis never received (it is unreachable)", len(self._pending))
        self.pipe.close()
        try:
            await asyncio.wait_for(self.r.aclose(), self.cfg.timeout * 2)
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
            pubsub = self._pubsub = self.r.pubsub()
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
                except Exception:  # not a cancellation: that must end the task
                    pass

    # -- limits ----------------------------------------------------------------------------------
    def _names(self, key: ApiKeyConfig) -> tuple[bytes, bytes, bytes, str]:
        """A key's Redis key names (rpm log, tpm bucket, lease set, budget prefix), made once per key:
        the hot path asks for them on every admission and settle."""
        names = self._key_names.get(key.hash)
        if names is None:
            if len(self._key_names) > 100_000:  # bounded: keys come and go while the gateway runs
                self._key_names.clear()
            h = key.hash[7:]
            names = self._key_names[key.hash] = (
                # ``:q``, not the former ``:r`` (a sorted set): during an upgrade an old replica's log under
                # the old name cannot answer WRONGTYPE to the new script; it expires on its own in 61 s.
                f"{self._p}:rl:{h}:q".encode(), f"{self._p}:rl:{h}:t".encode(), f"{self._p}:cc:{h}".encode(), f"{self._p}:bud:{h}:"
            )
        return names

    def _lease_key(self, key: ApiKeyConfig) -> bytes:
        return self._names(key)[2]

    def _budget_key(self, key: ApiKeyConfig) -> bytes:
        return (self._names(key)[3] + current_period_id(key.budget_period)).encode()

    def _admit_head(self, key: ApiKeyConfig) -> tuple[bytes, bytes]:
        """A key's ADMIT keys and limits, packed once per key and budget period: only the reservation
        and the lease id change from one request to the next. Equal heads share a call (``_admit_calls``)."""
        period = current_period_id(key.budget_period) if key.budget_tokens else ""
        hit = self._admit_heads.get(key.hash)
        if hit is not None and hit[0] is key and hit[1] == period:  # an edited key is a new object
            return hit[2]
        if len(self._admit_heads) > 100_000:  # bounded, as _names
            self._admit_heads.clear()
        r_key, t_key, cc_key, _ = self._names(key)
        keys = [r_key, t_key, cc_key, self._budget_key(key)]
        args = [key.rate_limit_rpm or 0, key.rate_limit_tpm or 0, key.max_concurrent or 0, self._lease_ttl_ms, key.budget_tokens or 0,
                int(self._grant_life * 1000)]
        head = (_bulks(keys), _bulks(args))
        self._admit_heads[key.hash] = (key, period, head)
        return head

    async def _decide(self, key: ApiKeyConfig, reserve: int, lease: str) -> tuple[Decision, bool, int]:
        if not self._down():
            r = b"%d" % reserve
            lid = lease.encode()
            tail = b"$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(r), r, len(lid), lid)
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            fut: asyncio.Future[Any] = loop.create_future()
            self._admits.append((self._admit_head(key), fut, tail, self._ask(key, reserve) if self._grant_life else None))
            if len(self._admits) == 1:
                loop.call_soon(self._send_admits)
            try:
                ok, reason, retry, r, k, reset = await fut
                if type(ok) is not int:
                    raise TypeError("not ADMIT's flag")
                d = Decision(ok == 1, reason.decode() if isinstance(reason, bytes) else str(reason), int(retry), _level(r), _level(k), int(reset))
            except (TypeError, ValueError):  # a reply that is not ADMIT's (Redis is not trusted): the fallback decides
                stats.STATE_ERRORS.labels(op="admit").inc()
            except Exception:
                pass
            else:
                if d.ok and lease:
                    self._leases[lease] = (self._names(key)[2], lease)
                return d, True, 1
        share = max(1, self.replicas)
        return self.fallback.admit(key, reserve, lease, share), False, share

    # -- grants (grants.py) ------------------------------------------------------------------------
    def _from_grant(self, key: ApiKeyConfig, reserve: int) -> tuple[Decision, str, Grant] | None:
        """An admission decided here, from the key's live grant, or None (then Redis decides)."""
        g = self._grants.get(key.hash)
        if g is None:
            return None
        now = time.monotonic()
        lease = g.take(reserve, now) if g.key is key else None
        if lease is None:
            if g.exhausted or now >= g.until or g.key is not key:
                self._end_grant(g)  # its leftovers back now, and this admission asks for the next
            return None
        if not g.renewing and g.renew_due(now) and not self._down():
            g.renewing = True
            self._renew_grant(g, now)
        return g.decision(now), lease, g

    def _ask(self, key: ApiKeyConfig, reserve: int, renewing: Grant | None = None) -> Ask | None:
        """The grant to ask for: with an admission going to Redis while the key has no grant, or
        alone to renew a grant running out. None while an ask for the key is in flight (answered,
        or given up after the call's deadline)."""
        h = key.hash
        if renewing is None and h in self._grants:
            return None
        now = time.monotonic()
        asked = self._asking.get(h)
        if asked is not None and now - asked < self.cfg.timeout * 2 + 0.1:
            return None
        if len(self._asking) > 100_000:  # bounded, as _names
            self._asking.clear()
        self._asking[h] = now
        if renewing is not None:
            requests, slots = renewing.next_ask(now, self._grant_life)
        else:
            requests, slots = self._next_ask.get(h, (ASK_FIRST, SLOTS_FIRST))
        return Ask(key, requests, requests * max(1, reserve) if key.rate_limit_tpm else 0, slots, f"{self.replica}.g{next(self._grant_ids)}")

    def _renew_grant(self, g: Grant, now: float) -> None:
        """The next grant asked for alone (an ADMIT call of no admissions) while this one still
        serves: its reply replaces it, so admissions keep being decided here."""
        ask = self._ask(g.key, g.reserve_each(), renewing=g)
        if ask is None:
            return
        fut = self.pipe.request(self._admit_call([], self._admit_head(g.key), [], ask=ask), 1)
        fut.add_done_callback(lambda f: self._renewed(ask, f))

    def _renewed(self, ask: Ask, f: asyncio.Future[list[Any]]) -> None:
        if f.cancelled():  # the pipe closed (shutdown)
            self._asking.pop(ask.key.hash, None)
            return
        exc = f.exception()
        res = f.result()[0] if exc is None else exc
        if isinstance(res, list) and len(res) == 7:
            self._granted(ask, res)
            return
        self._asking.pop(ask.key.hash, None)
        if not _noscript(res):  # a restarted Redis: the next admission that goes there loads the scripts
            stats.STATE_ERRORS.labels(op="admit").inc()

    def _granted(self, ask: Ask, tail: list[Any]) -> None:
        """The grant part of an ADMIT reply (7 values): a live grant for the key when one was made."""
        key = ask.key
        self._asking.pop(key.hash, None)
        if self._closing:  # ended grants were given back at close; a late one would only expire in Redis
            return
        try:
            requests, tokens, slots, r, k, reset, stamp = (int(tail[0]), int(tail[1]), int(tail[2]), _level(tail[3]), _level(tail[4]),
                                                           int(tail[5]), int(tail[6]))
        except (TypeError, ValueError):  # not ADMIT's (Redis is not trusted): no grant
            stats.STATE_ERRORS.labels(op="admit").inc()
            return
        if requests <= 0 or requests > ask.requests or tokens < 0 or tokens > ask.tokens or slots < 0 or slots > ask.slots:
            return
        if (key.max_concurrent and slots < 1) or (key.rate_limit_tpm and tokens < 1):
            return  # a grant of no slots would read as no cap (ADMIT grants at least 2, and tokens with a tpm limit)
        now = time.monotonic()
        g = Grant(
            key, requests if key.rate_limit_rpm else -1, tokens if key.rate_limit_tpm else -1,
            [f"{ask.grant_id}.{j}" for j in range(slots, 0, -1)] if key.max_concurrent else [], slots if key.max_concurrent else 0,
            b"%d" % stamp, now + self._grant_life, now, requests, r, k, reset, tokens,
        )
        old = self._grants.get(key.hash)
        if old is not None:
            self._end_grant(old)
        if len(self._grants) > 100_000:  # bounded: each ends within grant_seconds anyway
            for other in list(self._grants.values()):
                self._end_grant(other)
        self._grants[key.hash] = g
        loop = self._loop or asyncio.get_running_loop()
        loop.call_later(self._grant_life, self._end_grant, g)

    def _end_grant(self, g: Grant) -> None:
        """A grant's end: what it left unused goes back to Redis with the next write (its rpm entries,
        tokens and free slots), and its slots still in use become ordinary leases (renewed by the
        heartbeat, dropped at their settle)."""
        if g.ended:
            return
        g.ended = True
        key = g.key
        h = key.hash
        if self._grants.get(h) is g:
            del self._grants[h]
        if len(self._next_ask) > 100_000:
            self._next_ask.clear()
        self._next_ask[h] = g.next_ask(time.monotonic(), self._grant_life)
        r_key, t_key, cc_key, _ = self._names(key)
        for lease in g.busy:
            self._leases[lease] = (cc_key, lease)
        unused = max(0, g.requests)
        tokens = max(0, g.tokens)
        free, g.free = tuple(g.free), []
        if unused or tokens or free:
            self._queue_settle(Settle(
                t_key, key.rate_limit_tpm or 0, tokens, cc_key, "", b"", 0, -1, b"", "", 0, 0, False, False, 0,
                r_key, g.stamp, unused, free,
            ))

    def end_grants(self) -> None:
        """Every live grant ended now (shutdown, and tests that read Redis's counts)."""
        for g in list(self._grants.values()):
            self._end_grant(g)

    def _pack(self, calls: list[tuple[Any, list[bytes], list[Any]]]) -> bytes:
        """EVALSHA commands in RESP, packed here: redis-py's general packer costs more than the script."""
        buf: list[bytes] = []
        for script, keys, args in calls:
            buf += (_evalsha(script, len(keys), len(args)), _bulks(keys), _bulks(args))
        return b"".join(buf)

    @staticmethod
    def _admit_calls(batch: list[_Admit]) -> list[tuple[tuple[bytes, bytes], list[int]]]:
        """The admissions grouped into ADMIT calls: one per key (by its packed head), in the order
        the keys first came, each key's admissions in the order they came, at most GROUP a call."""
        groups: dict[tuple[bytes, bytes], list[int]] = {}
        for i, a in enumerate(batch):
            idx = groups.get(a[0])
            if idx is None:
                groups[a[0]] = [i]
            else:
                idx.append(i)
        calls: list[tuple[tuple[bytes, bytes], list[int]]] = []
        for head, idx in groups.items():
            if len(idx) <= GROUP:
                calls.append((head, idx))
            else:
                calls += [(head, idx[j : j + GROUP]) for j in range(0, len(idx), GROUP)]
        return calls

    def _admit_call(self, batch: list[_Admit], head: tuple[bytes, bytes], idx: list[int], keys: list[bytes] | None = None,
                    args: list[Any] | None = None, ask: Ask | None = None) -> bytes:
        """One ADMIT call: a key's admissions ``idx`` of ``batch`` (and the first grant they ask for,
        or ``ask``), carrying one SETTLE_MANY call's keys and arguments after its own when given."""
        n = b"%d" % len(idx)
        nk, na = (len(keys), len(args)) if keys is not None and args is not None else (0, 0)
        if ask is None:
            ask = next((a for a in (batch[i][3] for i in idx) if a is not None), None)
        asked = _bulks((ask.requests, ask.tokens, ask.slots, ask.grant_id)) if ask is not None else NO_ASK
        return b"".join((
            _evalsha(self._admit, 4 + nk, 11 + 2 * len(idx) + na), head[0], _bulks(keys) if nk else b"", head[1],
            b"$%d\r\n%s\r\n" % (len(n), n), asked, *[batch[i][2] for i in idx], _bulks(args) if na else b"",  # type: ignore[arg-type]
        ))

    async def _eval_many(self, op: str, calls: list[tuple[Any, list[bytes], list[Any]]]) -> list[Any]:
        """Run scripts as one batch of EVALSHA commands: one write, one round trip on the pipe. A Redis
        that lost its scripts (restarted) gets them loaded and the batch re-run once. Results may hold
        per-call ``ReplyError``s."""
        return await self._eval_packed(op, self._pack(calls), len(calls))

    async def _eval_packed(self, op: str, packed: bytes, n: int) -> list[Any]:
        """``_eval_many`` of ``n`` commands already packed."""
        for attempt in (0, 1):
            results = await self._call(op, self._send_raw(packed, n))
            if attempt == 0 and any(_noscript(r) for r in results):
                await self._load_scripts()
                continue
            return results
        raise AssertionError("unreachable")

    async def _load_scripts(self) -> None:
        for script in (self._admit, self._settle_many, self._renew, self._exchange_script):
            script.sha = await self._call("script_load", self.r.script_load(script.script))

    async def _send_raw(self, packed: bytes, n: int) -> list[Any]:
        """``n`` packed commands on the hot-path pipe, bounded by its deadline (state.timeout x 2)."""
        return await self.pipe.request(packed, n)

    def _send_admits(self) -> None:
        """Every admission asked for in this turn of the loop goes in one write on the pipe, with no
        task: the replies are handed out by a callback (one round trip however many arrived together).
        The admissions of one key share one ADMIT call (``_admit_calls``). The settles waiting to be
        flushed ride in those calls: each of the first calls carries one SETTLE_MANY call's worth (at
        most ``CHUNK`` settles), and only what is left over (a backlog after an outage) goes as
        SETTLE_MANY calls in the same write. Holding admissions while a batch is in flight was tried:
        no bigger batches at c=32 (~5 admissions a write either way), so none wait."""
        batch, self._admits = self._admits, []
        if not batch:
            return
        calls = self._admit_calls(batch)
        folded: list[_Call] = []
        lone: list[_Call] = []
        if self._pending:
            settles = settle_calls(self._take_settles())
            folded, lone = settles[: len(calls)], settles[len(calls) :]
        cmds = [
            self._admit_call(batch, head, idx, folded[j][0], folded[j][1]) if j < len(folded) else self._admit_call(batch, head, idx)
            for j, (head, idx) in enumerate(calls)
        ]
        if lone:
            cmds.append(self._pack([(self._settle_many, keys, args) for keys, args, _ in lone]))
        fut = self.pipe.request(b"".join(cmds), len(calls) + len(lone))
        fut.add_done_callback(lambda f: self._admits_done(batch, calls, folded, lone, f))

    def _admits_done(self, batch: list[_Admit], calls: list[tuple[tuple[bytes, bytes], list[int]]], folded: list[_Call],
                     lone: list[_Call], f: asyncio.Future[list[Any]]) -> None:
        exc = f.exception()
        if exc is not None:
            stats.STATE_ERRORS.labels(op="admit").inc()
            self._mark_down("admit")
            self._admits_failed(batch, exc)
            self._requeue([s for _, _, carried in folded + lone for s in carried])
            return
        results = f.result()
        n = len(calls)
        self._settled(lone, results[n:])
        results = results[:n]
        # A carrying call that failed is asked again without its settles, so that the admissions' answers
        # are their own; its settles are dropped and counted, as a SETTLE_MANY call's error is (the script
        # may have applied them before failing), or requeued when Redis lost the script (none ran).
        again = self._settled(folded, results[: len(folded)])
        if any(_noscript(r) for r in results):  # a restarted Redis (rare): reload, then run the batch again
            self._admit_again(batch)
            return
        if again:
            self._admit_again([batch[i] for j in again for i in calls[j][1]])
            for j in again:
                results[j] = None  # handed out by the second call
        self._hand_out(batch, calls, results)

    def _admit_again(self, batch: list[_Admit]) -> None:
        task = asyncio.get_running_loop().create_task(self._run_admits(batch))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    def _admits_failed(self, batch: list[_Admit], exc: BaseException) -> None:
        for a in batch:
            fut = a[1]
            if not fut.done():
                fut.set_exception(exc)

    def _hand_out(self, batch: list[_Admit], calls: list[tuple[tuple[bytes, bytes], list[int]]], results: list[Any]) -> None:
        """Each admission its reply: the 6 values of its place in its call's (None: not this call's,
        it was sent again), and the call's grant to the key that asked. A call's error, or a reply of
        the wrong shape, fails all its admissions."""
        for (_, idx), res in zip(calls, results):
            if res is None:
                continue
            if not isinstance(res, Exception) and (not isinstance(res, list) or len(res) != 6 * len(idx) + 7):
                res = ConnectionError("an ADMIT reply of the wrong shape")
            if isinstance(res, Exception):
                stats.STATE_ERRORS.labels(op="admit").inc()
                for i in idx:
                    fut = batch[i][1]
                    if not fut.done():
                        fut.set_exception(res)
                continue
            ask = next((a for a in (batch[i][3] for i in idx) if a is not None), None)
            if ask is not None:
                self._granted(ask, res[6 * len(idx) :])
            for j, i in enumerate(idx):
                fut = batch[i][1]
                if not fut.done():
                    fut.set_result(res[6 * j : 6 * j + 6])

    async def _run_admits(self, batch: list[_Admit]) -> None:
        calls = self._admit_calls(batch)
        try:
            packed = b"".join([self._admit_call(batch, head, idx) for head, idx in calls])
            results = await self._eval_packed("admit", packed, len(calls))
        except Exception as exc:
            self._admits_failed(batch, exc)
            return
        self._hand_out(batch, calls, results)

    def _settle(self, adm: Admission, used: int, prompt: int, completion: int, estimated: bool, counted: bool) -> None:
        key = adm.key
        lease = adm.lease
        if lease:
            g = adm.grant
            if g is not None and g.release(lease):
                lease = ""  # back in its live grant: nothing for Redis
            else:
                self._leases.pop(lease, None)
        shared = adm.shared
        if not shared and key.limited:
            self.fallback.settle(key, adm.reserved, used, adm.lease, max(1, self.replicas))
        if not shared and not counted:
            return
        now = time.time()
        _, t_key, cc_key, _ = self._names(key)
        # The budget is charged whoever admitted the request: one admitted by the fallback during an
        # outage is charged when its settle reaches Redis (a budget is never refunded, so late is exact).
        budget = key.budget_tokens
        hour = hour_of(now)
        usage_key = self._usage_keys.get(hour)
        if usage_key is None:
            self._usage_keys = {hour: f"{self._p}:usage:{hour}".encode()}
            usage_key = self._usage_keys[hour]
        settle = Settle(
            t_key, (key.rate_limit_tpm or 0) if shared else 0, adm.reserved - used if shared else 0,
            cc_key, lease if shared else "",
            self._budget_key(key) if budget else b"", used, period_seconds_left(key.budget_period, now) if budget else -1,
            usage_key, f"{key.hash[7:]}|{adm.model}", prompt, completion, estimated, counted, self.cfg.usage_retention_days * 86400,
        )
        self._queue_settle(settle)

    def _queue_settle(self, settle: Settle) -> None:
        if not self._pending:
            self._pending_since = time.monotonic()
        if (settle.lease or settle.leases) and not self._lease_since:
            self._lease_since = time.monotonic()
        if len(self._pending) >= self.max_pending:
            self._pending.popleft()
            self._dropped(1)
        self._pending.append(settle)
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

    def _take_settles(self) -> list[Settle]:
        batch = list(self._pending)
        self._pending.clear()
        self._lease_since = 0.0
        return batch

    def _requeue(self, batch: list[Settle]) -> None:
        """Kept for later (bounded): usage and budget are counted once Redis is back; leases expire on
        their own. The batch goes back before what arrived meanwhile, so the oldest are the ones dropped."""
        if not batch:
            return
        room = max(0, self.max_pending - len(self._pending))
        if room < len(batch):
            self._dropped(len(batch) - room)
        if not self._pending:
            self._pending_since = time.monotonic()
        if not self._lease_since and any(s.lease or s.leases for s in batch):
            self._lease_since = time.monotonic()
        self._pending.extendleft(reversed(batch[len(batch) - room :]))
        self._wake.set()

    def _settled(self, calls: list[_Call], results: list[Any]) -> list[int]:
        """The replies to settle calls (alone, or carried by an admission): a script Redis lost (restarted)
        sends its settles round again (through the flusher, which loads it); any other error reply is
        counted and its settles dropped. Returns the indices of the calls whose settles were dropped."""
        failed: list[int] = []
        for j, ((_, _, carried), res) in enumerate(zip(calls, results)):
            if _noscript(res):
                self._requeue(carried)
            elif isinstance(res, Exception):
                failed.append(j)
        if failed:
            stats.STATE_ERRORS.labels(op="settle").inc(len(failed))
        return failed

    async def _flush(self) -> None:
        if not self._pending:
            return
        batch = self._take_settles()
        calls = settle_calls(batch)
        try:
            results = await self._eval_many("settle", [(self._settle_many, keys, args) for keys, args, _ in calls])
        except Exception:
            self._requeue(batch)
            raise
        self._settled(calls, results)

    async def _flusher(self) -> None:
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            # Settles ride on the next admission write (_send_admits takes them all); only those that waited
            # FLUSH_EVERY (a lease to drop) or FLUSH_USAGE_EVERY for none go on their own. Without grants an
            # admission under load always comes first: no write of their own.
            while self._pending and not self._closing:
                due = self._pending_since + self.flush_usage_every
                if self._lease_since:
                    due = min(due, self._lease_since + self.flush_every)
                wait = due - time.monotonic()
                if wait <= 0:
                    break
                await asyncio.sleep(min(wait, self.flush_every))  # a lease to drop may come meanwhile
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
        if self.local_load is None:
            pipe.delete(f"{self._p}:load:{self.replica}")
        res = await self._call("heartbeat", pipe.execute(raise_on_error=False))
        if any(isinstance(r, NoScriptError) for r in res):  # a restarted Redis: load the scripts again
            await self._load_scripts()
        errors = [r for r in res if isinstance(r, Exception) and not isinstance(r, NoScriptError)]
        if errors:
            stats.STATE_ERRORS.labels(op="heartbeat").inc()
            self._mark_down("heartbeat")
            raise errors[0]
        self.replicas = max(1, int(res[2]))
        if self.local_load is not None:
            await self._exchange(None)  # this replica's load written and the others' read, as every load_interval
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
        await self._exchange(publish)

    async def _exchange(self, publish: tuple[str, bytes] | None) -> None:
        args: list[Any] = [self._load_ttl_ms, self.replica, f"{self._p}:load:"]
        entry = self.local_load()
        for field, n in entry.items():
            args += (field, n)
        packed = self._pack([(self._exchange_script, [f"{self._p}:load:{self.replica}".encode(), f"{self._p}:replicas".encode()], args)])
        n = 1
        if publish is not None:
            packed += pack(b"PUBLISH", publish[0].encode(), publish[1])
            n = 2
        res = await self._eval_packed("load", packed, n)
        errors = [r for r in res if isinstance(r, Exception)]
        if errors:  # as a failed call: counted, and Redis taken for down (what the redis-py pipeline did)
            stats.STATE_ERRORS.labels(op="load").inc()
            self._mark_down("load")
            raise errors[0]
        total = _sum_loads([_pairs(e) for e in res[0]]) if isinstance(res[0], list) else {}
        self.load = total
        self.load_sent = bool(entry)
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


def _pairs(entry: Any) -> dict[Any, Any] | None:
    """A flat HGETALL reply (as a script returns it) as a mapping; anything else is skipped by _sum_loads."""
    if not isinstance(entry, list) or len(entry) % 2 or len(entry) > 2 * MAX_LOAD_FIELDS:
        return None
    return dict(zip(entry[::2], entry[1::2]))


def _evalsha(script: Any, n_keys: int, n_args: int) -> bytes:
    """The start of an EVALSHA command in RESP, up to its keys."""
    nk = b"%d" % n_keys
    return b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$%d\r\n%s\r\n" % (3 + n_keys + n_args, script.sha.encode(), len(nk), nk)


def _bulks(items: Iterable[Any]) -> bytes:
    """Keys or arguments as RESP bulk strings (ints and strs, in the main: settle args are ~2 a request)."""
    buf: list[bytes] = []
    for a in items:
        t = a.__class__
        item = a if t is bytes else b"%d" % a if t is int else a.encode() if t is str else _arg(a)
        buf.append(b"$%d\r\n%s\r\n" % (len(item), item))
    return b"".join(buf)


def _level(v: Any) -> float:
    """A level from an ADMIT reply: a finite number (an infinite or NaN one from a Redis that is not
    ours would reach the rate-limit headers, which cannot format it)."""
    x = float(v)
    if not math.isfinite(x):
        raise ValueError(f"not a finite level: {v!r}")
    return x


def _noscript(r: Any) -> bool:
    return isinstance(r, ReplyError) and str(r).startswith("NOSCRIPT")


def _arg(a: Any) -> bytes:
    if isinstance(a, bytes):
        return a
    if isinstance(a, int):
        return b"%d" % a
    return str(a).encode()
