"""Settling in Redis: the requests that ended meanwhile, folded into one script call.

A settle gives back (or takes) tpm tokens, drops a concurrency lease, charges the budget and counts
usage. One script call per request cost Redis more CPU than the admission itself (a script run and
~9 commands each), so the settles gathered since the last write go as one call's worth (per ``CHUNK``
of them), carried by the next admission's ``ADMIT`` call (``settle_many`` below, run before the
admission), or as a ``SETTLE_MANY`` call of their own when no admission comes; grouped by Redis key:

- tpm buckets: refilled once, then each amount applied in order with the cap after each (what
  settling them one by one would do, so a stream that ran over still takes its tokens);
- lease sets: one ZREM of all the ids;
- budgets: one INCRBY of the summed tokens (a budget only grows, so the sum is exact);
- usage hashes (one per hour): one HINCRBY per field of the summed counts;
- rpm logs: a grant's unused entries taken back when it ends (``grants.py``), one LREM each.
"""

from __future__ import annotations

from typing import Any, NamedTuple

CHUNK = 500  # settles per script call (alone or carried): bounds its arguments, run time and the Lua stack for unpack()

# A tpm bucket written back (ADMIT in redis.py and SETTLE_MANY both use it): its level and time, and
# its expiry ('e') moved to 240 s ahead only when under 120 s are left, so it outlives its last update
# by 120 s without a PEXPIRE on every update (each write command is ~1.3 us of Redis CPU).
STORE_TPM = """
local function store_tpm(key, level, expiry, now)
  if expiry and expiry - now >= 120000 then
    redis.call('HSET', key, 'l', tostring(level), 't', now)
  else
    redis.call('HSET', key, 'l', tostring(level), 't', now, 'e', now + 240000)
    redis.call('PEXPIRE', key, 240000)
  end
end
"""

# The settles of one call, from KEYS[k] and ARGV[i] on (SETTLE_MANY: from the first; ADMIT: after its
# own 4 keys and 11 + 2n arguments, when an admission carries them). Returns the next KEYS index.
SETTLE_FN = """
local function settle_many(k, i, now)
  local groups = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, groups do -- tpm buckets: tpm, n, then n amounts to give back (negative: to take), in order
    local tpm, n = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
    local v = redis.call('HMGET', KEYS[k], 'l', 't', 'e')
    local l = tonumber(v[1])
    if l then
      l = l + (now - tonumber(v[2])) * tpm / 60000
      if l > tpm then l = tpm end
      for j = i + 2, i + 1 + n do
        l = l + tonumber(ARGV[j])
        if l > tpm then l = tpm end
      end
      store_tpm(KEYS[k], l, tonumber(v[3]), now)
    end
    k, i = k + 1, i + 2 + n
  end
  groups = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, groups do -- lease sets: n, then n lease ids
    local n = tonumber(ARGV[i])
    redis.call('ZREM', KEYS[k], unpack(ARGV, i + 1, i + n))
    k, i = k + 1, i + 1 + n
  end
  groups = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, groups do -- budget counters: tokens, ttl (s, 0: forever)
    redis.call('INCRBY', KEYS[k], ARGV[i])
    local ttl = tonumber(ARGV[i + 1])
    if ttl > 0 then redis.call('EXPIRE', KEYS[k], ttl) end
    k, i = k + 1, i + 2
  end
  groups = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, groups do -- usage hashes: ttl (s), n, then n (field, increment) pairs
    local ttl, n = ARGV[i], tonumber(ARGV[i + 1])
    for j = i + 2, i + 2 * n, 2 do redis.call('HINCRBY', KEYS[k], ARGV[j], ARGV[j + 1]) end
    redis.call('EXPIRE', KEYS[k], ttl)
    k, i = k + 1, i + 2 + 2 * n
  end
  groups = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, groups do -- rpm logs: a grant's unused entries taken back: n, then n (time, count) pairs
    local n = tonumber(ARGV[i])
    for j = i + 1, i + 2 * n, 2 do redis.call('LREM', KEYS[k], ARGV[j + 1], ARGV[j]) end
    k, i = k + 1, i + 1 + 2 * n
  end
  return k
end
"""

# The settles alone (no admission came to carry them within FLUSH_EVERY, or more than the admissions
# of one write carry: see redis.py). Returns the number of keys settled.
SETTLE_MANY = STORE_TPM + SETTLE_FN + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return settle_many(1, 1, now) - 1
"""


class Settle(NamedTuple):
    """One ended request, as it waits to reach Redis (empty keys and zeros: nothing of that kind)."""

    tpm_key: bytes
    tpm: int  # 0: no tpm bucket to settle (no limit, or admitted by the local fallback)
    back: int  # tokens to give back (negative: to take)
    lease_key: bytes
    lease: str  # "": no lease to drop
    budget_key: bytes
    used: int
    budget_ttl: int  # -1: no budget; 0: kept forever
    usage_key: bytes
    field: str  # "<key hash>|<model>"
    prompt: int
    completion: int
    estimated: bool
    counted: bool  # False: nothing to count (the request got no answer)
    usage_ttl: int
    # A grant's end (grants.py): its unused rpm entries (log, their time, how many) and free slots.
    rpm_key: bytes = b""
    stamp: bytes = b""
    unused: int = 0
    leases: tuple[str, ...] = ()


def settle_calls(settles: list[Settle]) -> list[tuple[list[bytes], list[Any], list[Settle]]]:
    """SETTLE_MANY calls (keys, args) for these settles, each with the settles it carries."""
    return [_one_call(settles[i : i + CHUNK]) for i in range(0, len(settles), CHUNK)]


def _one_call(settles: list[Settle]) -> tuple[list[bytes], list[Any], list[Settle]]:
    tpm: dict[bytes, tuple[int, list[int]]] = {}
    leases: dict[bytes, list[str]] = {}
    budgets: dict[bytes, list[int]] = {}  # key -> [tokens, ttl]
    usage: dict[bytes, tuple[int, dict[str, int]]] = {}
    logs: dict[bytes, list[tuple[bytes, int]]] = {}
    for s in settles:
        if s.tpm > 0 and s.back != 0:
            group = tpm.get(s.tpm_key)
            if group is None:
                group = tpm[s.tpm_key] = (s.tpm, [])
            group[1].append(s.back)
        if s.lease:
            leases.setdefault(s.lease_key, []).append(s.lease)
        if s.leases:
            leases.setdefault(s.lease_key, []).extend(s.leases)
        if s.unused > 0:
            logs.setdefault(s.rpm_key, []).append((s.stamp, s.unused))
        if s.budget_ttl >= 0 and s.used > 0:
            b = budgets.get(s.budget_key)
            if b is None:
                budgets[s.budget_key] = [s.used, s.budget_ttl]
            else:
                b[0] += s.used
                b[1] = s.budget_ttl  # the latest settle's, as when each set its own
        if s.counted:
            hit = usage.get(s.usage_key)
            if hit is None:
                hit = usage[s.usage_key] = (s.usage_ttl, {})
            fields = hit[1]
            f = s.field
            fields[f + "|p"] = fields.get(f + "|p", 0) + s.prompt
            fields[f + "|c"] = fields.get(f + "|c", 0) + s.completion
            fields[f + "|n"] = fields.get(f + "|n", 0) + 1
            if s.estimated:
                fields[f + "|e"] = fields.get(f + "|e", 0) + 1
    keys: list[bytes] = []
    args: list[Any] = [len(tpm)]
    for key, (cap, backs) in tpm.items():
        keys.append(key)
        args += (cap, len(backs), *backs)
    args.append(len(leases))
    for key, ids in leases.items():
        keys.append(key)
        args += (len(ids), *ids)
    args.append(len(budgets))
    for key, (tokens, ttl) in budgets.items():
        keys.append(key)
        args += (tokens, ttl)
    args.append(len(usage))
    for key, (ttl, fields) in usage.items():
        keys.append(key)
        args += (ttl, len(fields))
        for f, n in fields.items():
            args += (f, n)
    args.append(len(logs))
    for key, taken in logs.items():
        keys.append(key)
        args.append(len(taken))
        for stamp, n in taken:
            args += (stamp, n)
    return keys, args, settles
