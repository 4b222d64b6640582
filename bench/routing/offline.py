"""Offline replay: the routing bench's trace through the real policies and a virtual-time copy of
the simulator's engine model (``gateway/sim/engine.py``), with no sockets and no processes.

    python -m bench.routing.offline [--fleets ...] [--loads ...] [--duration 120]
    python -m bench.routing.offline --replicas 4 ...   # N gateway replicas sharing the fleet (issue 12)

It runs in seconds, so a change to the model can be tried on many seeds before the socket bench
(``python -m bench.routing``) confirms it. What it leaves out: HTTP and SSE costs, timer slack,
health checks, retries. Its figures are not the bench's figures.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import json
import itertools
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "bench.routing"

from gateway.config.balancer import BalancerConfig  # noqa: E402
from gateway.routing.policies import Outcome, make_balancer, request_info  # noqa: E402
from gateway.routing.policies.base import Balancer  # noqa: E402
from gateway.config.balancer import DEFAULT_PRIORITY, PRIORITY_NAMES  # noqa: E402
from gateway.config.state import StateConfig  # noqa: E402
from gateway.routing.pool import Backend  # noqa: E402
from gateway.routing.queue import Admission, Waiter  # noqa: E402
from gateway.routing.signals import Signals, update_signals  # noqa: E402
from gateway.sim.prefix_cache import PrefixCache  # noqa: E402
from gateway.state.cluster import apply_load, learn_placements, load_entry, placements_message  # noqa: E402
from gateway.sim.tokens import render_chat, text_prompt  # noqa: E402

from .run import FLEETS, POLICIES  # noqa: E402
from .trace import SimParams, fleet_capacity, make_trace, mixed_trace  # noqa: E402


class Loop:
    def __init__(self) -> None:
        self.now = 0.0
        self._q: list = []
        self._ids = itertools.count()

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._q, (t, next(self._ids), fn, args))

    def run(self) -> None:
        while self._q:
            t, _, fn, args = heapq.heappop(self._q)
            self.now = t
            fn(*args)


@dataclass(eq=False)
class Seq:
    index: int
    tokens: int
    blocks: tuple
    out: int
    req: object
    sent: float
    generated: int = 0
    cached: int = 0
    first: float | None = None


class Engine:
    """The simulator's continuous-batching model, step for step, in virtual time."""

    def __init__(self, loop: Loop, p: SimParams, speed: float, on_token, on_done):
        self.loop, self.p, self.speed = loop, p, speed
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.pending = 0
        self.kv = 0
        self.cache = PrefixCache()
        self.busy = False
        self.on_token, self.on_done = on_token, on_done
        self.prompt_tokens = self.cached_tokens = self.generated = 0
        self.gauges = (0, 0, 0.0)
        self.steps = self.admitted = 0
        self.step_s = self.queue_wait_s = 0.0  # the socket bench's --verbose prints the sims' own

    def __repr__(self) -> str:
        return f"{self.step_s:.1f} ({self.steps}) {self.queue_wait_s / max(1, self.admitted):.3f}"

    def submit(self, s: Seq) -> None:
        self.pending += 1
        self.loop.at(self.loop.now + self.p.ttft / self.speed, self._enqueue, s)

    def _enqueue(self, s: Seq) -> None:
        self.pending -= 1
        self.waiting.append(s)
        if not self.busy:
            self.busy = True
            self._step()

    def _room(self) -> int:
        return (self.p.kv_capacity_tokens - self.kv) // self.p.block_tokens

    def _step(self) -> None:
        admitted = []
        while self.waiting and len(self.running) < self.p.max_batch_size:
            s = self.waiting[0]
            if self.running and self.kv + s.tokens + s.out > self.p.kv_capacity_tokens:
                break
            self.waiting.pop(0)
            self.admitted += 1
            self.queue_wait_s += self.loop.now - s.sent - self.p.ttft / self.speed
            s.cached = min(self.cache.match(s.blocks) * self.p.block_tokens, s.tokens - 1)
            self.kv += s.tokens + s.out
            self.running.append(s)
            admitted.append(s)
            self.prompt_tokens += s.tokens
            self.cached_tokens += s.cached
        if admitted:
            self.cache.shrink(self._room())
        if not self.running:
            self.busy = False
            return
        p = self.p
        uncached = sum(s.tokens - s.cached for s in admitted)
        step = (uncached / p.prefill_tokens_per_s + p.tpot * (1 + len(self.running) * p.batch_slowdown)) / self.speed
        self.steps += 1
        self.step_s += step
        self.loop.at(self.loop.now + step, self._advance, admitted)

    def _advance(self, admitted: list[Seq]) -> None:
        room = self._room()
        for s in admitted:
            self.cache.insert(s.blocks, room)
        keep = []
        for s in self.running:
            s.generated += 1
            self.generated += 1
            if s.first is None:
                s.first = self.loop.now
                self.on_token(self, s)
            if s.generated >= s.out:
                self.kv -= s.tokens + s.out
                self.on_done(self, s)
            else:
                keep.append(s)
        self.running = keep
        self._step()

    def refresh(self) -> None:
        self.gauges = (len(self.running), len(self.waiting), self.kv / self.p.kv_capacity_tokens)


class CacheAwareCopy(Balancer):
    """The SGLang model gateway's ``cache_aware`` as its docs describe it (HTTP mode: a radix tree of
    request text per worker), for the replay only: when loads are balanced (in flight, max - min at
    most ``balance_abs`` or max at most ``balance_rel`` x min) the worker whose tree matches the
    longest prefix of the text, if it covers more than ``cache_threshold`` of it; otherwise the
    least loaded. The tree is a sorted list per worker: the longest common prefix with a set of
    strings is the one with a neighbour in sort order. No eviction (a 60-s trace never fills it)."""

    name = "smg:cache_aware"

    def __init__(self, *args, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.texts: dict[str, list[str]] = {}
        self.text_of: dict[int, str] = {}  # id(RequestInfo): its rendered prompt, set by the replay

    @staticmethod
    def _lcp(a: str, b: str) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i

    def _match(self, b: Backend, text: str) -> int:
        xs = self.texts.get(b.id, [])
        i = bisect.bisect_left(xs, text)
        return max((self._lcp(text, xs[j]) for j in (i - 1, i) if 0 <= j < len(xs)), default=0)

    def pick(self, candidates, req):
        loads = [b.in_flight for b in candidates]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return self._least(candidates, lambda b: b.in_flight)
        text = self.text_of.get(id(req), "")
        best = max(candidates, key=lambda b: self._match(b, text))
        if text and self._match(best, text) / len(text) > self.cache_threshold:
            return best
        return self._least(candidates, lambda b: b.in_flight)

    def dispatched(self, backend, req):
        super().dispatched(backend, req)
        text = self.text_of.pop(id(req), "")
        if text:
            bisect.insort(self.texts.setdefault(backend.id, []), text)


def policy_spec(spec: str, cfg: BalancerConfig) -> tuple[str, BalancerConfig]:
    """``name`` or ``name:field=value+field=value`` (a variant of a policy's knobs, for comparing them)."""
    name, _, knobs = spec.partition(":")
    changes: dict = {}
    queue: dict = {}
    for kv in filter(None, knobs.split("+")):
        k, _, v = kv.partition("=")
        target, base = (queue, cfg.queue) if hasattr(cfg.queue, k) else (changes, cfg)
        default = getattr(base, k)
        target[k] = v in ("1", "true", "on") if isinstance(default, bool) else v if isinstance(default, str) else (int(v) if default is None else type(default)(v))
    if queue:
        changes["queue"] = dataclasses.replace(cfg.queue, **queue)
    return name, dataclasses.replace(cfg, **changes)


def replay(policy: str, speeds: list[float], trace, params: SimParams, cfg: BalancerConfig, seed: int = 0, warmup: float = 0.1,
           replicas: int = 1, interval: float = StateConfig.load_interval, push_gap: float = 0.0, relay: float = 0.0) -> dict:
    """``replicas`` > 1: that many gateways (a policy, its own Backend objects, queue and scrapes each)
    share the engines; request i goes to replica ``i % replicas``. Each sees the others only as the
    load exchange (``gateway/state/cluster.py``) shows them: every ``interval`` a replica publishes
    its in-flight counts (and what else ``shared_load`` gives) and reads the others' last published
    ones (phases staggered, so up to ``interval`` stale); its prefix placements reach the others then."""
    # relay: seconds from an engine's token to the gateway seeing it (the socket bench measures ~0.008 s
    # from the sims' own times to the client's); the balancer learns from the delayed times, as on sockets.
    loop = Loop()
    spec = policy
    if spec.startswith("smg:") and spec != "smg:cache_aware":
        raise SystemExit(f"{spec}: the replay has a copy of smg:cache_aware only; run the binary's other policies on sockets (python -m bench.routing)")
    policy, cfg = (spec, cfg) if spec == "smg:cache_aware" else policy_spec(spec, cfg)
    n = replicas

    def new_balancer(r: int) -> Balancer:
        rng = random.Random(seed * 1000 + r)
        if policy == "smg:cache_aware":
            return CacheAwareCopy(cfg, clock=lambda: loop.now, rng=rng)
        return make_balancer(policy, cfg, clock=lambda: loop.now, rng=rng)

    bals = [new_balancer(r) for r in range(n)]
    fleets = [[Backend(id=f"b{i}", url="", models=frozenset({"m"}), healthy=True, returned_at=0.0) for i in range(len(speeds))]
              for _ in range(n)]
    results: dict[int, tuple[float, float]] = {}
    served: dict[int, tuple[int, int, int, int]] = {}  # index: (engine, cached tokens, prompt tokens, output tokens)
    refused: dict[int, tuple[float, int]] = {}  # index: (seconds to the refusal, status)
    arrived: dict[int, float] = {}
    owner: dict[int, int] = {}  # request index: its replica
    adms = [Admission(cfg.queue, bals[r], (lambda model, r=r: fleets[r]), lambda: loop.now) if cfg.queue.enabled and bals[r].predicts else None
            for r in range(n)]

    def on_token(engine, s: Seq) -> None:
        if relay > 0:
            loop.at(loop.now + relay, _first_byte, engine, s)
        else:
            _first_byte(engine, s)

    def _first_byte(engine, s: Seq) -> None:
        r = owner[s.index]
        bals[r].first_byte(fleets[r][engines.index(engine)], s.req, loop.now - s.sent)

    def on_done(engine, s: Seq) -> None:
        if relay > 0:
            loop.at(loop.now + relay, _done, engine, s)
        else:
            _done(engine, s)

    def _done(engine, s: Seq) -> None:
        r = owner.pop(s.index)
        b = fleets[r][engines.index(engine)]
        bals[r].completed(b, s.req, Outcome(status=200, ok=True, ttft=s.first - s.sent,
                                            prompt_tokens=s.tokens, completion_tokens=s.out, cached_tokens=s.cached))
        t0 = arrived.pop(s.index)
        results[s.index] = (loop.now - t0, s.first + relay - t0)
        served[s.index] = (engines.index(engine), s.cached, s.tokens, s.out)
        changed(r)
        if adms[r] is not None:
            adms[r].completed("m")
            drain(r)

    engines = [Engine(loop, params, sp, on_token, on_done) for sp in speeds]
    signals = [[Signals(max_age=30.0) for _ in speeds] for _ in range(n)]

    def submit(r: int, b: Backend, i: int, item, req) -> None:
        changed(r)
        e = engines[fleets[r].index(b)]
        prompt = text_prompt(render_chat(item.body), params.block_tokens)
        e.submit(Seq(i, prompt.tokens, prompt.blocks, item.output_tokens, req, loop.now))

    waiting: dict[int, tuple] = {}  # id(waiter): (waiter, index, item)

    def drain(r: int) -> None:
        for w in adms[r].drain("m"):
            _, i, item = waiting.pop(id(w))
            submit(r, w.backend, i, item, w.req)

    def expire(w, r: int) -> None:
        if adms[r].expire(w):
            _, i, _ = waiting.pop(id(w))
            owner.pop(i)
            refused[i] = (loop.now - arrived.pop(i), w.refusal.status)

    def arrive(i: int, item) -> None:
        r = i % n
        bal, adm, backends = bals[r], adms[r], fleets[r]
        req = request_info("m", item.body)
        req.stream = True
        arrived[i] = loop.now
        owner[i] = r
        if isinstance(bal, CacheAwareCopy):
            bal.text_of[id(req)] = render_chat(item.body)
        if adm is None:
            b = bal.pick(backends, req)
            bal.dispatched(b, req)
            submit(r, b, i, item, req)
            return
        got = adm.admit(req, item.key, PRIORITIES.get(item.key, DEFAULT_PRIORITY))
        for v in adm.displaced:
            _, j, _ = waiting.pop(id(v))
            owner.pop(j)
            refused[j] = (loop.now - arrived.pop(j), v.refusal.status)
        adm.displaced.clear()
        if isinstance(got, Backend):
            submit(r, got, i, item, req)
        elif isinstance(got, Waiter):
            waiting[id(got)] = (got, i, item)
            loop.at(got.deadline, expire, got, r)
        else:
            refused[i] = (0.0, got.status)
            arrived.pop(i)
            owner.pop(i)

    def pending() -> bool:
        return len(results) + len(refused) < len(trace.items)

    def refresh() -> None:
        for e in engines:
            e.refresh()
        if pending():
            loop.at(loop.now + params.metrics_interval, refresh)

    def scrape(r: int) -> None:
        for b, e, sig in zip(fleets[r], engines, signals[r]):
            run, w, kv = e.gauges
            tokens = e.prompt_tokens + e.generated  # counters are live, like the sim's
            changed = update_signals(sig, {"lmdeploy:num_requests_running": run, "lmdeploy:num_requests_waiting": w,
                                           "lmdeploy:gpu_cache_usage_perc": kv, "lmdeploy:generation_tokens_total": tokens}, loop.now)
            bals[r].observe_signals(b, sig, changed)
        if adms[r] is not None:
            drain(r)
        if pending():
            loop.at(loop.now + cfg.scrape_interval, scrape, r)

    published: list[dict[str, int]] = [{} for _ in range(n)]  # each replica's last load entry

    pushing = [False] * n
    last_push = [-1.0] * n

    def changed(r: int) -> None:
        # push_gap > 0: a replica publishes its entry soon after its load changes (at most every
        # push_gap s), and the others apply it on arrival (pub/sub, 1 ms), between the regular exchanges.
        if n > 1 and push_gap > 0 and not pushing[r]:
            pushing[r] = True
            loop.at(max(loop.now, last_push[r] + push_gap), push, r)

    def push(r: int) -> None:
        pushing[r] = False
        last_push[r] = loop.now
        published[r] = load_entry(fleets[r], bals[r])
        for o in range(n):
            if o != r:
                loop.at(loop.now + 0.001, read, o)

    def read(r: int) -> None:
        totals: dict[str, int] = {}
        for o in range(n):
            if o != r:
                for k, v in published[o].items():
                    totals[k] = totals.get(k, 0) + v
        if apply_load(fleets[r], totals) and adms[r] is not None:
            drain(r)

    def exchange(r: int) -> None:
        # What Cluster does every state.load_interval: publish ours (and our placements), read the others'.
        published[r] = load_entry(fleets[r], bals[r])
        bal = bals[r]
        if bal.placements is not None and len(bal.placements):
            msg = placements_message(f"r{r}", bal.placements)  # as Cluster sends it, and reads it below
            for r2 in range(n):
                if r2 != r:
                    learn_placements(msg, f"r{r2}", lambda bid, r2=r2: fleets[r2][int(bid[1:])], bals[r2])
        read(r)
        if pending():
            loop.at(loop.now + interval, exchange, r)

    for i, item in enumerate(trace.items):
        loop.at(item.at, arrive, i, item)
    loop.at(0.0, refresh)
    for r in range(n):
        if cfg.scrape_interval > 0:
            loop.at(0.05 + r * cfg.scrape_interval / n, scrape, r)
        if n > 1:
            if bals[r].shares_prefixes:
                bals[r].share_placements()
            loop.at(r * interval / n, exchange, r)
    loop.run()
    skip = int(len(trace.items) * warmup)
    lat = sorted(results[i][0] for i in range(skip, len(trace.items)) if i in results)
    ttft = sorted(results[i][1] for i in range(skip, len(trace.items)) if i in results)
    shed = sorted(refused[i][0] for i in range(skip, len(trace.items)) if i in refused)
    prompt = sum(e.prompt_tokens for e in engines)
    by_key = {}
    for key in {it.key for it in trace.items}:
        mine = sorted(results[i][1] for i in range(skip, len(trace.items)) if i in results and trace.items[i].key == key)
        by_key[key] = {"ttft_p99": _p99(mine), "lat_p99": _p99(sorted(results[i][0] for i in range(skip, len(trace.items)) if i in results and trace.items[i].key == key)),
                       "refused": sum(1 for i in range(skip, len(trace.items)) if i in refused and trace.items[i].key == key),
                       "done": sum(1 for i, (lat, _) in results.items() if trace.items[i].key == key and trace.items[i].at + lat <= trace.duration)}  # the key's throughput
    return {
        "by_key": by_key,
        "policy": spec,
        "lat_mean": statistics.fmean(lat),
        "lat_p50": lat[len(lat) // 2],
        "lat_p99": lat[min(len(lat) - 1, int(0.99 * (len(lat) - 1) + 0.5))],
        "ttft_mean": statistics.fmean(ttft),
        "ttft_p50": ttft[len(ttft) // 2],
        "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * (len(ttft) - 1) + 0.5))],
        "refused": len(shed),
        "refusal_p99": shed[min(len(shed) - 1, int(0.99 * (len(shed) - 1) + 0.5))] if shed else 0.0,
        "hit_rate": sum(e.cached_tokens for e in engines) / prompt if prompt else 0.0,
        "share": "/".join(f"{100 * e.prompt_tokens / prompt:.0f}" for e in engines) if prompt else "",
        # Requests per engine, as the socket bench's "share %" counts them (the prompt-token share above is not comparable to it).
        "req_share": _req_share([e for e, _, _, _ in served.values()], len(engines)),  # all of them, warm-up included, as there
        "engines": "  ".join(map(repr, engines)),
        "learnt": _learnt(bals[0], fleets[0]),
        "requests": [{"i": i, "backend": served[i][0], "latency": results[i][0], "ttft": results[i][1], "cached": served[i][1],
                      "prompt": served[i][2], "out": served[i][3]} for i in sorted(results)],
    }


def _learnt(bal: Balancer, backends: list[Backend]) -> str:
    """What an expected-latency balancer learnt (as the socket bench's --verbose state shows it)."""
    if not hasattr(bal, "gamma"):
        return ""
    fleet = bal.fleet_sigma(backends)
    sigma = "/".join(f"{bal.sigma(b, fleet):.4f}" for b in backends)
    slots = "/".join(str(bal.models(b).slots) for b in backends)
    kv = "/".join(f"{bal.models(b).kv_capacity or 0:.0f}" for b in backends)
    return f"gamma {bal.gamma:.4f} rho {bal.rho:.4f} sigma {sigma} slots {slots} kv {kv} affinity picks {bal.affinity_picks}/{bal.picks}"


PRIORITIES = {"ui": PRIORITY_NAMES["interactive"], "bulk": PRIORITY_NAMES["batch"]}  # the mixed run's keys


def _req_share(engine_of: list[int], engines: int) -> str:
    """Each engine's share of the requests, in %, as "43/23/22/12"."""
    return "/".join(f"{100 * engine_of.count(e) / len(engine_of):.0f}" for e in range(engines)) if engine_of else ""


def _p99(xs: list[float]) -> float:
    return xs[min(len(xs) - 1, int(0.99 * (len(xs) - 1) + 0.5))] if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing.offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleets", default="heterogeneous,homogeneous")
    ap.add_argument("--loads", default="0.6,0.8,0.95")
    # smg:least_load is the binary's own policy, with no copy here (smg:cache_aware has one)
    ap.add_argument("--policies", default=",".join(p for p in POLICIES if p != "smg:least_load"))
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--seeds", default="7")
    ap.add_argument("--shared", type=float, default=0.5)
    ap.add_argument("--mean", action="store_true", help="per fleet and load, also print each policy's figures averaged over --seeds")
    ap.add_argument("--replicas", type=int, default=1, help="gateways sharing the fleet, requests alternated (the replicas scenario)")
    ap.add_argument("--load-interval", type=float, default=StateConfig.load_interval, help="with --replicas: seconds between load exchanges")
    ap.add_argument("--push-gap", type=float, default=0.0, help="with --replicas: also publish a replica's load this soon after it changes")
    ap.add_argument("--dump", type=Path, default=None, help="write each run's per-request backend, latency, TTFT, cached tokens into this folder")
    ap.add_argument("--relay", default="0", help="seconds the relay adds to each first byte and end (what the balancer sees and the client "
                    "measures; the socket bench's --verbose shows 0.007-0.013); a comma list replays each trace once per value, and --mean "
                    "averages over all: a 40-s trace's median moves by +-0.05 s with a few ms of timing, as on sockets")
    ap.add_argument("--rng", default="0", help="offsets to each trace's seed for the balancers' tie-breaking only; a comma list replays each "
                    "trace once per value, and --mean averages over all: one broken tie moves a 60-s trace's TTFT p99 by up to 15 %%, "
                    "so a gap smaller than what this moves is noise")
    ap.add_argument("--verbose", action="store_true", help="per backend: step seconds, steps, mean queue wait for a slot")
    ap.add_argument("--mixed", action="store_true", help="interactive short requests (key ui) at --loads, alone and with a batch flood (key bulk) at 100%%")
    args = ap.parse_args(argv)
    params = SimParams()
    cfg = BalancerConfig(scrape_interval=2.0)
    if args.mixed:
        relays = [float(x) for x in args.relay.split(",")]
        for fleet in args.fleets.split(","):
            speeds = FLEETS[fleet]
            cap = fleet_capacity(params, speeds, 7, "m", args.shared)
            for load in (float(x) for x in args.loads.split(",")):
                # policy: [(change %, ui TTFTs alone, ui TTFTs beside the flood, those of the first third, bulk done)] per seed and relay
                mixed: dict[str, list[tuple[float, list[float], list[float], list[float], list[float], int]]] = {}
                for seed in (int(s) for s in args.seeds.split(",")):
                    alone = mixed_trace(seed, interactive_rate=load * cap, batch_rate=0.0, duration=args.duration, model="m")
                    flood = mixed_trace(seed, interactive_rate=load * cap, batch_rate=cap, duration=args.duration, model="m")
                    print(f"\nmixed {fleet}: interactive at {load:.0%}, alone and with a batch flood at 100%; seed {seed}")
                    for policy, relay in itertools.product(args.policies.split(","), relays):
                        ra = replay(policy, speeds, alone, params, cfg, seed, relay=relay)
                        rf = replay(policy, speeds, flood, params, cfg, seed, relay=relay)
                        a, f = ra["by_key"]["ui"], rf["by_key"]
                        change = 100 * (f["ui"]["ttft_p99"] / a["ttft_p99"] - 1)
                        label = policy if relay == 0 else f"{policy} relay {relay:g}"
                        print(f"  {label:<44} ui ttft p99 {a['ttft_p99']:.3f} -> {f['ui']['ttft_p99']:.3f} ({change:+.0f}%)"
                              f"  ui lat p99 {a['lat_p99']:.2f} -> {f['ui']['lat_p99']:.2f}  ui shed {f['ui']['refused']}  bulk shed {f['bulk']['refused']}  bulk lat p99 {f['bulk']['lat_p99']:.2f}  bulk done {f['bulk']['done']}")
                        if args.verbose:
                            print(f"    flood, per backend: step s (steps) mean queue wait s: {rf['engines']}; {rf['learnt']}")
                        # The counted ui requests' TTFTs (the first 10 % of the trace's requests left out, as by_key does),
                        # and those beside the flood in the first third of the trace (the warm-up, before much is learnt).
                        ua = [x["ttft"] for x in ra["requests"] if x["i"] >= int(len(alone.items) * 0.1) and alone.items[x["i"]].key == "ui"]
                        uf = [(flood.items[x["i"]].at, x["ttft"]) for x in rf["requests"] if x["i"] >= int(len(flood.items) * 0.1) and flood.items[x["i"]].key == "ui"]
                        mixed.setdefault(policy, []).append((change, ua, [t for _, t in uf], [t for at, t in uf if at < args.duration / 3],
                                                             [t for at, t in uf if at >= args.duration / 3], f["bulk"]["done"]))
                if args.mean:
                    print(f"\nmixed {fleet} {load:.0%}, over seeds {args.seeds}" + (f" and relays {args.relay} s" if "," in args.relay else "")
                          + ": ui TTFT p99 change beside the flood (mean, max, runs over +25 %); the p99 alone -> beside the flood (means over the runs); pooled ui TTFT p99 of all runs alone ->"
                          " beside the flood, and beside it in the first / last two thirds of each trace; bulk done (sum)")
                    for policy, rs in mixed.items():
                        ch = [r[0] for r in rs]
                        pa, pf = statistics.fmean(_p99(sorted(r[1])) for r in rs), statistics.fmean(_p99(sorted(r[2])) for r in rs)
                        pool = [sorted(itertools.chain.from_iterable(r[k] for r in rs)) for k in (1, 2, 3, 4)]
                        print(f"  {policy:<44} mean {statistics.fmean(ch):+5.1f}%  max {max(ch):+4.0f}%  over 25 % {sum(c > 25 for c in ch):2d}/{len(ch)}"
                              f"  p99 {pa:.3f} -> {pf:.3f}  pooled {_p99(pool[0]):.3f} -> {_p99(pool[1]):.3f} ({100 * (_p99(pool[1]) / _p99(pool[0]) - 1):+.0f}%)"
                              f"  first third {_p99(pool[2]):.3f} rest {_p99(pool[3]):.3f}  bulk done {sum(r[5] for r in rs)}")
        return 0
    for fleet in args.fleets.split(","):
        speeds = FLEETS[fleet]
        for load in (float(x) for x in args.loads.split(",")):
            runs: dict[str, list[dict]] = {}
            for seed in (int(s) for s in args.seeds.split(",")):
                cap = fleet_capacity(params, speeds, seed, "m", args.shared)
                trace = make_trace(seed, rate=load * cap, duration=args.duration, model="m", shared_share=args.shared)
                print(f"\n{fleet} {load:.0%} seed {seed}: {len(trace.items)} requests")
                base = None
                for policy, relay, tie in itertools.product(args.policies.split(","), [float(x) for x in args.relay.split(",")], [int(x) for x in args.rng.split(",")]):
                    r = replay(policy, speeds, trace, params, cfg, seed + tie, replicas=args.replicas, interval=args.load_interval, push_gap=args.push_gap, relay=relay)
                    runs.setdefault(policy, []).append(r)
                    if args.dump is not None:
                        args.dump.mkdir(parents=True, exist_ok=True)
                        (args.dump / f"replay-{fleet}-{load:g}-{seed}-{relay:g}{f'-rng{tie}' if tie else ''}-{policy.replace(':', '_')}.json").write_text(json.dumps(r["requests"]))
                    base = base or r
                    label = (policy if relay == 0 else f"{policy} relay {relay:g}") + (f" rng +{tie}" if tie else "")
                    print(f"  {label:<36} lat mean {r['lat_mean']:6.2f} p50 {r['lat_p50']:6.2f} p99 {r['lat_p99']:6.2f} "
                          f"({100 * (r['lat_p99'] / base['lat_p99'] - 1):+4.0f}%)  ttft mean {r['ttft_mean']:.3f} p50 {r['ttft_p50']:.3f} "
                          f"p99 {r['ttft_p99']:.3f}  hit {r['hit_rate']:.1%}  refused {r['refused']} (p99 {r['refusal_p99']:.2f}s)  prompt share {r['share']}  requests {r['req_share']}")
                    if args.verbose:
                        print(f"    per backend: step s (steps) mean queue wait s: {r['engines']}; {r['learnt']}")
            if args.mean:
                print(f"\n{fleet} {load:.0%}, mean over seeds {args.seeds}" + (f" and relays {args.relay} s" if "," in args.relay else "")
                      + (f" and rng offsets {args.rng}:" if "," in args.rng else ":"))
                print(f"  {'policy':<44} lat mean  lat p50  lat p99  ttft mean  ttft p99    hit")
                for policy, rs in runs.items():
                    m = {k: statistics.fmean(r[k] for r in rs) for k in ("lat_mean", "lat_p50", "lat_p99", "ttft_mean", "ttft_p99", "hit_rate")}
                    print(f"  {policy:<44} {m['lat_mean']:8.3f} {m['lat_p50']:8.3f} {m['lat_p99']:8.3f} {m['ttft_mean']:10.3f} {m['ttft_p99']:9.3f} {m['hit_rate']:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
