"""What replicas and workers share about the backends, through the Redis store.

- Load: every ``state.load_interval`` (and with each heartbeat; at rest less often, see
  ``Cluster.quiet``) a replica writes its in-flight count per backend under a key that expires
  with ``state.lease_ttl`` (a dead replica's counts vanish on their own) and reads the others';
  their sum lands in ``Backend.remote_in_flight``. With a balancer that models them, also what
  those requests hold (``Backend.remote_kv``, ``remote_decode``, ``remote_prefill``): its prefix
  memory and the KV capacity it learns from /metrics need the whole backend's reservations, and
  its latency estimate the others' work, not only their number.
  When it goes down on some backend, ``freed`` is called: the gateway queue may bind a waiter there.
- Prefix placements: with a balancer that keeps a prefix memory (``shares_prefixes``), the prefix
  keys it sent to each backend since the last exchange ride on the same round trip, published on
  ``<p>:prefixes``; the others add them to that backend's memory, so a prompt first routed by one
  replica finds its cached prefix through any replica. Best effort: a message lost (Redis down, a
  subscription reconnecting) only costs affinity, and each replica keeps its own table meanwhile.
- Ejection: when this replica ejects a failing backend it publishes the backend id and how long;
  the others eject it for as long (an ejection they learn is not published again).
- Directory: the one process that launches api_servers (worker 0 of ``--workers N``) publishes
  the launched backends' addresses, models, role and batch slots every second (the followers'
  queues and PD dispatch need the last two); followers add them to their pool (calling them with
  the internal key the ``--workers`` parent handed every worker, never a key read from Redis) and
  drop those that go.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import orjson

from .redis import RedisStore, stop_tasks

log = logging.getLogger("gateway.state.cluster")

DIRECTORY_EVERY = 1.0
# While nothing is in flight here or at any other replica, the load is exchanged this often (and
# with each heartbeat) instead of every load_interval: a fleet at rest then costs Redis 4 round trips
# a second per worker, not 50. Measured on an idle 2-worker gateway: 76 ms of its CPU a second and
# 24 of Redis's before, 35-40 and 5 after (the rest is mostly the 50 ticks a second that notice a
# request). A request of ours ends the rest at the next tick; the others' first requests after a
# rest are seen at most this late.
QUIET_EXCHANGE_EVERY = 0.25
DIRECTORY_TTL_MS = 5000
MAX_CHAINS_PER_BACKEND = 1024  # in one received placements message (a sender logs no more)
MAX_CHAIN_KEYS = 16  # a prompt has at most len(routing.prefix.BOUNDARIES) keys
# One sender's message is at most 1024 chains of 11 keys (~250 KB); anything larger is not one of ours.
MAX_PLACEMENTS_BYTES = 1 << 20
# A load entry's fields beside the in-flight count: what a replica's requests on a backend hold, as its
# balancer counts it (KV tokens reserved, output tokens left, prompt tokens to prefill). Each name starts
# with NUL, which no backend id does, and each value stays an integer (an older replica adds every field
# up as a count of some backend it does not have).
KV_FIELD = "\x00kv\x00"
DECODE_FIELD = "\x00dec\x00"
PREFILL_FIELD = "\x00pre\x00"


def load_entry(backends: Any, balancer: Any) -> dict[str, int]:
    """What this replica publishes on the load exchange: its in-flight count per backend and, from a
    balancer that models them (``shared_load``), what those requests hold there."""
    out: dict[str, int] = {}
    for b in backends:
        if b.in_flight > 0:
            out[b.id] = b.in_flight
            kv, decode, prefill = balancer.shared_load(b) if balancer is not None else (0.0, 0.0, 0.0)
            if kv >= 1:  # the sign that the rest is told: a request in flight holds some KV
                out[KV_FIELD + b.id] = int(kv)
                out[DECODE_FIELD + b.id] = int(decode)
                out[PREFILL_FIELD + b.id] = int(prefill)
    return out


def apply_load(backends: Any, totals: dict[str, int]) -> bool:
    """The other replicas' summed entries into each backend; True when some in-flight count went down."""
    lower = False
    for b in backends:
        n = totals.get(b.id, 0)
        lower = lower or n < b.remote_in_flight
        b.remote_in_flight = n
        told = n > 0 and totals.get(KV_FIELD + b.id, 0) > 0
        b.remote_kv = totals[KV_FIELD + b.id] if told else 0
        b.remote_decode = totals.get(DECODE_FIELD + b.id, 0) if told else 0
        b.remote_prefill = totals.get(PREFILL_FIELD + b.id, 0) if told else 0
    return lower


MAX_PROMPT_TOKENS = 10_000_000  # a placed prompt's size; larger is not a real prompt
# Speed observations (y, n̄) in one received message, per backend (a sender's log holds 1024 in all), and
# the range of real ones: an observation outside is dropped, as it would skew every replica's σ and γ.
MAX_SPEEDS_PER_BACKEND = 1024
MAX_SECONDS_PER_TOKEN = 600.0
MAX_BATCH = 1_000_000.0


def placements_message(replica: str, placements: Any) -> bytes:
    """The placements since the last exchange (``routing.prefix.Placements``), drained into one message:
    ``p`` the key chains per backend, ``t`` their prompts' tokens in the same order (a replica that
    predates ``t`` reads ``p`` alone), and ``o`` the policy's speed observations per backend (y, n̄ pairs
    flat; a replica that predates ``o`` ignores it)."""
    chains, tokens = placements.drain_sized()
    msg: dict[str, Any] = {"from": replica, "p": chains, "t": tokens}
    speeds = placements.drain_speeds()
    if speeds:
        msg["o"] = speeds
    return orjson.dumps(msg)


def learn_placements(data: bytes | str, replica: str, backend: Callable[[str], Any], balancer: Any) -> None:
    """Another replica's placements message into ``balancer``'s prefix memory, and its speed observations
    into ``balancer.learn_speeds`` (a replica's own message is skipped: never counted twice). Redis content
    is not trusted: the size is checked before the parse, every chain and count is validated, a backend's
    token counts that are not one valid count per chain are ignored (its chains still count), and an
    observation that is not a (y, n̄) pair of finite numbers in range is dropped."""
    if len(data) > MAX_PLACEMENTS_BYTES:
        return  # checked before the parse: its cost stays bounded whatever lands on the channel
    try:
        msg = orjson.loads(data)
    except orjson.JSONDecodeError:
        return
    if not isinstance(msg, dict) or msg.get("from") == replica or not isinstance(msg.get("p"), dict):
        return
    sizes = msg.get("t")
    for bid, chains in msg["p"].items():
        b = backend(bid)
        if b is None or not isinstance(chains, list):
            continue  # a backend this replica does not have (yet)
        tokens = sizes.get(bid) if isinstance(sizes, dict) else None
        if not (isinstance(tokens, list) and len(tokens) == len(chains)
                and all(type(t) is int and 0 <= t <= MAX_PROMPT_TOKENS for t in tokens[-MAX_CHAINS_PER_BACKEND:])):
            tokens = None
        valid = [i for i, c in enumerate(chains[-MAX_CHAINS_PER_BACKEND:], start=max(0, len(chains) - MAX_CHAINS_PER_BACKEND))
                 if isinstance(c, list) and 0 < len(c) <= MAX_CHAIN_KEYS and all(type(k) is int for k in c)]
        if valid:
            balancer.learn_placements(b, [chains[i] for i in valid], [tokens[i] for i in valid] if tokens is not None else None)
    speeds = msg.get("o")
    if isinstance(speeds, dict):
        for bid, flat in speeds.items():
            b = backend(bid)
            if b is None or not isinstance(flat, list) or len(flat) % 2:
                continue
            tail = flat[-2 * MAX_SPEEDS_PER_BACKEND:]  # the newest (an even count: pairs stay whole)
            pairs = [(float(y), float(n)) for y, n in zip(tail[::2], tail[1::2])
                     if type(y) in (int, float) and type(n) in (int, float) and 0.0 < y <= MAX_SECONDS_PER_TOKEN and 1.0 <= n <= MAX_BATCH]
            if pairs:
                balancer.learn_speeds(b, pairs)


class Cluster:
    def __init__(self, store: RedisStore, pool: Any, make_backend: Any, *, publish_backends: bool, follow_backends: bool,
                 backend_key: str | None = None, freed: Callable[[], None] | None = None, balancer: Any = None) -> None:
        """pool: the routing layer's BackendPool; make_backend: its Backend class; balancer: its policy
        (this layer sits below routing); backend_key: the launched backends' internal key (from the
        --workers parent); freed: told when the other replicas' in-flight count on some backend went down."""
        self.store = store
        self.freed = freed
        self.pool = pool
        self.make_backend = make_backend
        self.policy = balancer
        self.balancer = balancer if balancer is not None and balancer.shares_prefixes else None
        self.prefixes = f"{store.cfg.prefix}:prefixes"
        self.placements: Any = None  # the balancer's outbox (routing.prefix.Placements)
        self.publish_backends = publish_backends
        self.follow_backends = follow_backends
        self.backend_key = backend_key
        self.events = f"{store.cfg.prefix}:events"
        self.directory = f"{store.cfg.prefix}:backends"
        self._seen_ejections: dict[str, int] = {}
        self._learned: set[str] = set()  # backend ids added from the directory
        self._task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[Any]] = set()
        self._stopping = False
        # orjson writes "from" first (placements_message): the start of every message of ours, which
        # the channel echoes back to us
        self._own_message = orjson.dumps({"from": store.replica})[:-1] + b","

    def start(self) -> None:
        self.store.local_load = lambda: load_entry(self.pool, self.policy)
        self.store.on_load = self._apply_load
        self.store.handlers[self.events] = self._on_event
        if self.balancer is not None:
            self.placements = self.balancer.share_placements()
            self.store.handlers[self.prefixes] = self._on_placements
        self.pool.on_change(self._on_change)
        loop = asyncio.get_running_loop()
        self._load_task = loop.create_task(self._load_loop())
        if self.publish_backends or self.follow_backends:
            self._task = loop.create_task(self._directory_loop())

    async def stop(self) -> None:
        self._stopping = True  # the loops end at their next turn even if a cancellation is lost
        tasks = [t for t in (self._task, self._load_task, *self._sends) if t is not None]
        pending = await stop_tasks(tasks, self.store.cfg.timeout * 2)
        if pending:
            log.error("%d cluster task(s) did not stop at shutdown: %s", len(pending), pending)

    # -- load ------------------------------------------------------------------------------------
    async def _load_loop(self) -> None:
        # Every state.load_interval (0.02 s), not only with the 1-s heartbeat: measured with 4 replicas
        # round-robin on the routing bench, 1-s-old counts sent bursts to the same backend.
        exchanged = 0.0
        while not self._stopping:
            await asyncio.sleep(self.store.cfg.load_interval)
            if self.quiet() and time.monotonic() - exchanged < QUIET_EXCHANGE_EVERY:
                continue
            exchanged = time.monotonic()
            try:
                await self.store.exchange_load(self._placements_message())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("load exchange: %s", exc.__class__.__name__)

    def quiet(self) -> bool:
        """The fleet is at rest, as far as this replica can tell: no request of ours in flight now nor
        at the last exchange (the others have seen our last one end), none of the others' then, and
        no placements to send."""
        store = self.store
        local = store.local_load
        return (not store.load and not store.load_sent and (local is None or not local())
                and (self.placements is None or not len(self.placements)))

    def _apply_load(self, totals: dict[str, int]) -> None:
        if apply_load(self.pool, totals) and self.freed is not None:
            # Another replica's request finished: without this, a waiter here would wait for our own
            # next completion or /metrics poll to see the slot.
            self.freed()

    # -- prefix placements ------------------------------------------------------------------------------
    def _placements_message(self) -> tuple[str, bytes] | None:
        if self.placements is None or not len(self.placements):
            return None
        return self.prefixes, placements_message(self.store.replica, self.placements)

    def _on_placements(self, data: bytes | str) -> None:
        if isinstance(data, bytes) and data.startswith(self._own_message):
            return  # our own message, echoed by the channel: skipped before the parse
        learn_placements(data, self.store.replica, self.pool.get, self.balancer)

    # -- ejection ----------------------------------------------------------------------------------
    def _on_change(self, b: Any) -> None:
        now = time.monotonic()
        if b.ejected_until > now and self._seen_ejections.get(b.id) != b.ejections:
            self._seen_ejections[b.id] = b.ejections
            msg = orjson.dumps({"kind": "eject", "backend": b.id, "seconds": round(b.ejected_until - now, 3), "from": self.store.replica})
            task = asyncio.get_running_loop().create_task(self._publish(msg))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _publish(self, msg: bytes) -> None:
        try:
            await self.store._call("publish", self.store.r.publish(self.events, msg))
        except Exception:
            pass  # Redis down: the others find the failing backend out on their own

    def _on_event(self, data: bytes | str) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict) or event.get("from") == self.store.replica or event.get("kind") != "eject":
            return
        b = self.pool.get(str(event.get("backend")))
        seconds = event.get("seconds")
        if b is None or not isinstance(seconds, (int, float)) or not 0 < seconds <= 3600:
            return
        until = time.monotonic() + seconds
        if until > b.ejected_until:
            b.ejected_until = until
            b.returned_at = until  # ramped up slowly on return, as after a local ejection
            self._seen_ejections[b.id] = b.ejections
            log.warning("backend %s ejected for %.1fs: another replica saw it fail", b.id, seconds)

    # -- directory of launched backends ----------------------------------------------------------------
    async def _directory_loop(self) -> None:
        while not self._stopping:
            try:
                if self.publish_backends:
                    await self._publish_directory()
                if self.follow_backends:
                    await self._follow_directory()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("backend directory: %s", exc.__class__.__name__)
            await asyncio.sleep(DIRECTORY_EVERY)

    async def _publish_directory(self) -> None:
        entries = {
            # no key: anyone who reads Redis would have it
            b.id: orjson.dumps({"url": b.url, "models": sorted(b.models), "role": b.role, "slots": b.slots})
            for b in self.pool
            if b.origin == "launched"
        }
        pipe = self.store.r.pipeline(transaction=True)
        pipe.delete(self.directory)
        if entries:
            pipe.hset(self.directory, mapping=entries)
            pipe.pexpire(self.directory, DIRECTORY_TTL_MS)
        await self.store._call("directory", pipe.execute())

    async def _follow_directory(self) -> None:
        raw = await self.store._call("directory", self.store.r.hgetall(self.directory))
        present: set[str] = set()
        for k, v in raw.items():
            try:
                bid = k.decode() if isinstance(k, bytes) else k
                if not (bid.isprintable() and len(bid) <= 128):
                    raise ValueError("id")  # as a configured name must be (the load exchange's own fields start with NUL)
                entry = orjson.loads(v)
                url, models = str(entry["url"]), frozenset(str(m) for m in entry["models"])
                role, slots = _role(entry.get("role")), _slots(entry.get("slots"))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            present.add(bid)
            b = self.pool.get(bid)
            if b is None:
                self.pool.add(self.make_backend(id=bid, url=url, api_key=self.backend_key, models=models, static_models=True,
                                                origin="launched", role=role, slots=slots))
                self._learned.add(bid)
                log.info("backend %s learned from the launching process", bid)
            elif bid in self._learned:
                b.url, b.slots = url, slots
        for bid in list(self._learned - present):
            self.pool.remove(bid)
            self._learned.discard(bid)
            log.info("backend %s gone from the launching process", bid)


ROLES = ("hybrid", "prefill", "decode")


def _role(v: Any) -> str:
    """A directory entry's role; an entry from an older worker 0 has none (hybrid)."""
    if v is None:
        return "hybrid"
    if v not in ROLES:
        raise ValueError("role")
    return v


def _slots(v: Any) -> int | None:
    if v is None:
        return None
    if type(v) is not int or not 1 <= v <= 1_000_000:
        raise ValueError("slots")
    return v
