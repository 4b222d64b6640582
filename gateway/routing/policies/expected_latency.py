"""``min_expected_latency`` (default, ours): route each request to the backend where it is expected to finish first.

The model and how it is learnt are in ``ExpectedLatencyBalancer``'s docstring.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any, Sequence

from ...metrics import AFFINITY_PICKS
from ..looplag import LoopLag
from ..pool import Backend
from ..prefix import PrefixMemory, key_tokens
from ..signals import Signals, learn_slots
from .base import Balancer, Outcome, PerBackend, Prediction, RequestInfo
from .least_load import KV_PENALTY
from .sizes import Sizes, SizesByModel


class BackendModel:
    """What the expected-latency policy knows about one backend."""

    __slots__ = ("full_at", "done", "inflight", "area", "area_t", "w", "sn", "sy", "fit", "ext", "remote", "remote_max", "if_max", "slots", "kv", "kv_capacity", "prefixes", "signals", "prefilling", "slots_at")

    def __init__(self, now: float, prefixes: PrefixMemory):
        self.inflight: dict[int, RequestInfo] = {}  # requests this gateway has on it
        self.area = 0.0  # ∫ (sequences on the backend) dt: the mean batch over any window is Δarea / Δt
        self.area_t = now
        # Decayed sums over completions (λ = DECAY): count, mean batch n̄, seconds per output token y.
        # σ = Σy / Σ(1 + γ·n̄) = sy / (w + γ·sn).
        self.w = 0.0
        self.sn = 0.0
        self.sy = 0.0
        # Slower sums for the slope of y on n̄ (γ is a property of model and engine): w, Σn, Σn², Σy, Σny.
        self.fit = [0.0, 0.0, 0.0, 0.0, 0.0]
        self.ext = 0.0  # sequences on the backend that no gateway replica sent (direct clients), from /metrics
        self.remote = 0  # the other gateway replicas' requests on it (the load exchange's Backend.remote_in_flight)
        self.remote_max = 0  # most of theirs since the last scrape
        self.if_max = 0  # most of ours in flight since the last scrape
        self.slots: int | None = None  # the engine's batch slots, learnt when /metrics shows a queue or a first byte comes late
        self.full_at = 0  # sequences on the backend at the last sign of a full batch (a slot is learnt when two agree)
        self.slots_at = 0.0  # when the slots were learnt (diagnostics: the bench prints it)
        self.done: list[float] = []  # when the last few of ours completed
        self.kv = 0.0  # KV tokens our in-flight requests will hold (prompt + output each)
        self.prefilling = 0.0  # uncached prompt tokens of ours in flight with no first byte seen: kept, not summed per dispatch
        self.kv_capacity: float | None = None  # the engine's KV cache in tokens, from gpu_cache_usage_perc
        self.prefixes = prefixes
        self.signals: Signals | None = None  # the last poll of its /metrics

    def batch(self) -> float:
        """Sequences in the engine's batch: ours and others', at most its slots (the rest wait)."""
        n = len(self.inflight) + self.ext + self.remote
        return n if self.slots is None or n <= self.slots else float(self.slots)

    def advance(self, now: float) -> None:
        if now > self.area_t:
            self.area += self.batch() * (now - self.area_t)
            self.area_t = now


class ExpectedLatencyBalancer(Balancer):
    """Route each request to the backend where it is expected to finish first.

    Model of one backend b (continuous batching). A decode step with n sequences in the batch takes

        s_b(n) = σ_b · (1 + γ·n)

    σ_b is b's own speed (seconds per token of a lone sequence), γ how much each extra sequence
    slows a step (one value for the fleet: same model, same engine). A request r with d expected
    output tokens, joining sequences j that have rem_j tokens left, decodes d steps; at its step k
    the batch holds r and every j with rem_j ≥ k, so its steps sum to d·σ(1+γ) + σγ·Σ_j min(rem_j, d).
    With the prefill in front and the wait for a slot:

        L_b(r) = ( ρ·σ_b·(Q_b + P_b(r))                           prefill of the queued prompts, then r's
                 + σ_b·(1+γ)·d + σ_b·γ·S                          r's decode, S = Σ_j min(rem_j, d)
                 + s_b(n_b)·W_b                                   waiting for a batch slot or KV room
                 + ω·( σ_b·γ·S + s_b(n_b)·d·q_b / slots_b          the delay r adds to the others:
                       + ρ·σ_b·U_b(r)·n_b ) )                     slower steps, a queue, r's prefill stall
                 / ramp_b
               + KV_PENALTY · k_b / (1 - k_b)

    - Q_b: uncached prompt tokens of b's requests still in prefill. P_b(r): r's prompt tokens
      minus the prefix b served within ``AFFINITY_TTL`` and still holds (what its prefix cache will
      hit). The engine's prefix cache is an LRU in the KV memory its sequences leave free, so on a
      busy backend a prefix goes long before the TTL: the memory of b's prefixes (``PrefixMemory``)
      drops the oldest past that room (KV capacity, learnt from /metrics, less what b's sequences
      reserve), as the engine does. Without it the policy counted on documents that a full batch
      of long requests had pushed out (bench/routing/README.md of 227c192: prefix-cache hit 59.9 % -> 61.9 %
      on the heterogeneous fleet in the replay).
    - rem_j: j's expected output (max_tokens × the observed fill ratio, or the running mean) less
      what it decoded since its first byte. Work is counted in tokens, not requests.
    - j runs over this gateway's requests on b, the other gateway replicas' (their count and what
      they hold: KV, output left, prompt to prefill, from the load exchange every 50 ms; with them
      each replica's model of b is the whole backend's, bench/routing/README.md of 227c192 "Replicas scenario"),
      and ext_b more: running + waiting from b's /metrics less the most that we and the other
      replicas had on b between two polls (never negative). The gauges refresh every 10 s; until
      they change, the reservations are what counts. Others that nobody describes count at half the
      mean output each, a tenth of them in prefill.
    - W_b: decode steps until r is admitted: the (n+1-slots)-th smallest rem_j when the batch is
      full, or until enough j finish to free KV for r (prompt + output of all ours + r's over the
      KV capacity). slots_b and the KV capacity are learnt from /metrics; unknown means no limit.
    - ω = ``OTHERS_WEIGHT``: with 0, each request is selfish; with 1, the pick minimises the
      total latency added to the backend (r's own plus the slowdown and queueing it causes) to
      the sequences there now. The default 1.5 also counts, roughly, those that join b while r
      runs (the batch refills as it drains), which S and n_b do not see; over 8 seeds of the
      replay it beats 1 on median, mean, TTFT and hit rate, for +2% at p99. With slots_b known,
      ω_b = ω·(1 + ``OTHERS_LOAD``·u/(1-u)), u = min(0.9, (n_b + 1)/slots_b): the sequences that join
      while r runs are few on an idle backend and many on one whose slots are nearly all taken (u/(1-u),
      the mean queue of a server busy u of the time). It keeps the fastest backend from filling up
      with long requests, which slowed every step there (bench/routing/README.md of 227c192, ``slots=32``, 8
      seeds of the replay, heterogeneous fleet: median 2.181 -> 2.125 s, p99 17.7 -> 17.3 s).
      Sequences of a class below r's (the gateway queue sets each request's ``priority``) are left
      out of the slowdown and prefill stall r causes: an interactive request is not kept off a
      backend to spare a batch flood there (bench/routing/README.md of 227c192, mixed priority).
      q_b = how many would queue behind a full batch, r included. U_b(r) = r's uncached prompt
      tokens on b: its prefill runs inside one step of the whole batch, so each of the n_b sequences
      decoding there (at most slots_b) waits for it. This is what a prefix-cache hit saves the others,
      and it weighs affinity by the batch it would stall (bench/routing/README.md of 227c192: with ω = 1, over
      5 seeds of the replay, hit rate 57 % -> 60 % and mean TTFT -14 % on the heterogeneous fleet).
    - ramp_b = max(0.1, time since b returned / ``SLOW_START``): a backend back from ejection or
      unhealth looks slower than it is, so it fills up gradually instead of taking the queue;
      relative to the candidates' highest ramp, so backends that came up together (a gateway
      start) are taken as they are.
    - k_b: the scraped KV-cache usage (SGLang's term), ignored when the scrape is stale, and when
      b's batch slots are known: then W_b and the queue term predict the wait for a slot or KV room
      themselves, and the penalty, from a gauge up to 10 s old, would count that load twice and
      keep requests off the busiest (often fastest) backend for no wait it will cause.

    Learning, from the responses that pass through (usage, stream timing):
    - σ_b = Σλ y / Σλ (1 + γ·n̄) over b's completions, λ = 0.95 a completion; y = seconds per
      output token after the first byte, n̄ = the mean batch meanwhile (from a ∫batch dt counter).
      Blended with the fleet's pooled σ as one pseudo-observation, so a backend with no history
      starts at the fleet average, neither 0 nor ∞ (LMDeploy's min_observed_latency starves it).
    - γ: each backend's least-squares line y = a + c·n̄ (λ = 0.995), pooled as c/a weighted by the
      spread of its n̄, with the prior GAMMA0 as pseudo-data.
    - ρ: (TTFT − one step) / prefill tokens ahead, over σ, from streamed responses.
    - per model: the prompt-token correction (usage / our estimate), the max_tokens fill ratio,
      the mean output without max_tokens.

    The pick minimises L_b + ``TTFT_WEIGHT`` x b's predicted TTFT (the person waits for the first
    token, then reads as it streams). Prefix affinity: the backend that served the longest prefix of
    the prompt (at least ``AFFINITY_MIN_TOKENS``) wins if its score is within ``(1 + AFFINITY_BOUND)``
    of the best; if not, load wins. Ties break at random.

    The weights are constants, not settings: each value is the one the routing bench chose
    (bench/routing/README.md of 227c192; the comment beside each says which run).
    """

    name = "min_expected_latency"
    reads_prompt = True
    reads_signals = True
    predicts = True
    shares_prefixes = True
    SIGMA0 = 0.03  # prior seconds per token of a lone sequence, before any backend has history
    GAMMA0 = 0.01  # prior: each sequence in the batch adds 1% to a step
    RHO0 = 0.005  # prior: prefilling a token costs 0.5% of a decode step
    DECAY = 0.95  # per completion on the backend: σ follows the last ~20
    FIT_DECAY = 0.995  # γ follows the last ~200 completions of each backend
    GAMMA_PRIOR = 50.0  # the prior γ weighs as much as n̄ spread by ±1.6 over 20 completions
    MIN_RAMP = 0.1
    # A first byte this many decode steps past twice its predicted prefill waited for a slot, and past this many
    # times the gateway's own event-loop lag (a first byte crosses a couple of loop turns). Were 3 and 4: on sockets
    # the default row then learnt no slots, or 30 s late, and queued past the fast backend's batch (TTFT p50 0.205
    # against 0.176 in the replay; the replay with a constant 40-80 ms lag does the same). Two counts that agree still
    # set the slots; 3 x the lag still ignores a saturated gateway's lateness (bench/routing/README.md of 227c192, ninth pass).
    LATE_STEPS = 2
    LAG_MARGIN = 3.0
    MAX_LOAD = 0.9  # the slot load u at which OTHERS_LOAD's u/(1-u) stops growing (9x)
    # The prefix memory keeps what fits in this many times the KV its sequences leave free. Above 1 it leans
    # to affinity: a prefix near the end of the engine's LRU still draws its next request back to the backend
    # that most likely holds it (a hit, and the engine touches it again) instead of seeding a second copy
    # elsewhere. The replay (bench/routing/README.md of 227c192, hit-rate pass): 1.5 beats 1 on every column on the
    # heterogeneous fleet over 8 seeds x 5 relays, 40- and 60-s traces; 2 and 3 keep too many evicted prefixes.
    PREFIX_ROOM = 1.5
    # Were balancer settings until issue 33; each keeps the default the bench chose.
    # Hit-rate pass, 2026-12-03 (4d4bc9c): 1 (was 0.5) with PREFIX_ROOM 1.5 put the replay's prefix-cache hit rate ahead of SMG cache_aware.
    AFFINITY_BOUND = 1.0  # a backend holding the prompt's prefix wins if its score is within +100 % of the best; 0: affinity off
    # Ninth pass, 2026-12-03 (bench/routing/README.md of 227c192): 128 or 32 were within 0.003 s and 0.03 points of hit rate of 64.
    AFFINITY_MIN_TOKENS = 64  # a shared prefix shorter than this does not count
    # Third pass, 2026-12-03: on a busy backend the prefix memory's KV-room LRU evicts long before this; it bounds an idle one's.
    AFFINITY_TTL = 600.0  # seconds after which a served prefix is assumed evicted from the backend's cache
    # Second pass (relative ramp, 2026-12-03): 30 s from the gateway core; only a backend that comes back later than the rest ramps.
    SLOW_START = 30.0  # seconds over which a backend back from ejection or unhealth ramps up to full share; 0: off
    KV_PENALTY = KV_PENALTY  # seconds x k/(1-k), k = KV-cache usage, only while b's slots are unknown (least_load.py says why 0.15)
    # Third pass, 2026-12-03 (667851b): over 8 seeds of the replay 1.5 beat 1 on median, mean, TTFT and hit rate, for +2 % at p99.
    OTHERS_WEIGHT = 1.5  # how much the delay r adds to the others on b counts against b (0: none)
    # Fourth pass, 2026-12-03 (14e96ad): 0.2 / 0.3 / 0.5 / 1 gave median 2.113 / 2.104 / 2.117 / 2.097 s, a plateau: the smaller value.
    OTHERS_LOAD = 0.15  # with b's slots known, OTHERS_WEIGHT x (1 + this x u/(1-u)), u = b's slots taken (at most MAX_LOAD)
    # Tail-latency pass, 2026-12-02 (8f7a276): e2e + 8 x TTFT halved TTFT p99 at 80 % (0.96 against 1.78 s); the second pass's sweep of 2 / 4 / 8 closed no gap.
    TTFT_WEIGHT = 8.0  # seconds of end-to-end latency one second of TTFT is worth

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sizes = SizesByModel()
        self.gamma = self.GAMMA0
        self.models: PerBackend[BackendModel] = PerBackend(self._new_model)
        self._rho_num = 0.0
        self._rho_den = 0.0
        self._fleet = self.SIGMA0  # the candidates' pooled σ at the last pick
        self._top = 1.0  # the candidates' highest slow-start ramp at the last estimate
        self.affinity_picks = 0  # picks where affinity overrode the minimum
        self.picks = 0
        self.lag = LoopLag()  # the gateway's own delay, which a late first byte must exceed to teach slots
        self.lag_vetoes = 0  # late first bytes not taken as a full batch because the gateway's loop ran about as late (diagnostics)
        # (req, candidates, fleet σ, estimates) of the last predict, for the pick that follows it in the same
        # admission (the queue predicts, then binds); dropped by any event that changes what the model knows.
        self._memo: tuple[RequestInfo, Sequence[Backend], float, list[tuple[Prediction, int]]] | None = None

    # -- state --------------------------------------------------------------------------------
    def _new_model(self) -> BackendModel:
        m = BackendModel(self.clock(), PrefixMemory(ttl=self.AFFINITY_TTL))
        m.slots = self.config.slots
        return m

    def _model(self, b: Backend) -> BackendModel:
        m = self.models(b)
        if m.remote != b.remote_in_flight:
            # The others' requests count in the batch, for the step time and the ∫batch dt that σ is
            # learnt from: without them, each of N replicas saw a busy backend's batch as ~1/N of it,
            # learnt its σ too high and kept requests off the fastest backends.
            m.advance(self.clock())
            m.remote = b.remote_in_flight
            if m.remote > m.remote_max:
                m.remote_max = m.remote
        if m.slots is None and b.slots is not None:
            # Slots the launcher knows (the group's max_batch_size, the sim's default): no need to
            # wait for /metrics to show a queue. ``balancer.slots`` still wins when set.
            m.slots = b.slots
        return m

    def _sizes(self, model: str) -> Sizes:
        return self.sizes[model]

    def forget(self, backend_id: str) -> None:
        self._memo = None
        self.models.forget(backend_id)

    def learn_placements(self, backend: Backend, chains: Sequence[Sequence[int]], tokens: Sequence[int] | None = None) -> None:
        # Only the prefix memory: the other replica's load arrives as remote_in_flight and remote_kv.
        self._memo = None
        # With each prompt's size, the memory evicts past the room as for a prompt placed here.
        m, now = self._model(backend), self.clock()
        room = self._room(backend, m, min(backend.models)) if tokens is not None and backend.models else None
        for i, keys in enumerate(chains):
            m.prefixes.add(tuple(keys), now, tokens[i] if room is not None else 0.0, room)

    @property
    def rho(self) -> float:
        # Prior worth 20k prompt tokens, so a few early TTFTs do not swing it.
        return (self._rho_num + self.RHO0 * 20000) / (self._rho_den + 20000)

    def fleet_sigma(self, backends: Sequence[Backend] | None = None) -> float:
        """The pooled σ of the backends with history (the prior of a backend without)."""
        sy = sx = 0.0
        g = self.gamma
        for b in backends if backends is not None else ():
            m = self.models.get(b)
            if m is not None:
                sy += m.sy
                sx += m.w + g * m.sn
        return sy / sx if sx > 0 else self.SIGMA0

    def learnt(self, backends: Sequence[Backend]) -> dict[str, Any]:
        fleet = self.fleet_sigma(backends)
        per: dict[str, Any] = {}
        for b in backends:
            m = self.models.get(b)
            per[b.id] = {
                "sigma": self.sigma(b, fleet),  # seconds per output token at batch 1
                "slots": m.slots if m else None,  # batch slots (None: not known)
                "slots_learnt_at": m.slots_at if m and m.slots_at else None,  # monotonic clock
                "kv_capacity": m.kv_capacity if m else None,  # KV cache tokens (None: not known)
                "in_flight": len(m.inflight) if m else 0,
                "external": m.ext if m else 0.0,  # sequences no gateway replica sent, from /metrics
            }
        return {
            "policy": self.name, "gamma": self.gamma, "rho": self.rho, "fleet_sigma": fleet, "picks": self.picks,
            "affinity_picks": self.affinity_picks, "lag_vetoes": self.lag_vetoes, "backends": per,
            "sizes": {model: {"fill": sz.fill, "out_avg": sz.out_avg, "token_ratio": sz.token_ratio} for model, sz in self.sizes.items()},
        }

    def sigma(self, b: Backend, fleet: float) -> float:
        m = self.models.get(b)
        if m is None:
            return fleet
        return (m.sy + fleet) / (m.w + self.gamma * m.sn + 1.0)

    def _ramp(self, b: Backend, now: float) -> float:
        w = self.SLOW_START
        if w <= 0 or not b.returned_at:
            return 1.0
        return min(1.0, max(self.MIN_RAMP, (now - b.returned_at) / w))

    def _ramp_top(self, candidates: Sequence[Backend], now: float) -> None:
        # Slow start is relative: a backend ramps up against the others. When every candidate came
        # up together (a gateway start, the pool's first health checks), none is slower than the
        # rest, and dividing all predictions by the same small ramp would only make every backend
        # look busy to the queue (HOLD_WAIT) and the TTFT bound.
        self._top = max((self._ramp(c, now) for c in candidates), default=1.0)

    def _room(self, b: Backend, m: BackendModel, model: str) -> float | None:
        """Tokens b's prefix cache can hold now: the KV cache less what its sequences reserve (ours,
        and the others' at the mean request size); None while the KV capacity is unknown."""
        if m.kv_capacity is None:
            return None
        ext = m.ext + b.remote_in_flight
        # The other replicas' reservations as they count them; the rest (direct clients, a replica that
        # does not send its KV) at the mean request size.
        known = b.remote_in_flight if b.remote_kv > 0 else 0
        free = m.kv_capacity - m.kv - b.remote_kv - max(0.0, ext - known) * self._sizes(model).tokens_avg
        return self.PREFIX_ROOM * free if free > 0.0 else 0.0

    # -- the estimate -----------------------------------------------------------------------------
    def expected_latency(self, b: Backend, req: RequestInfo, now: float, fleet: float, depth: int | None = None) -> tuple[float, int]:
        """(L_b(r), prefix depth b holds for r); ``req.out_tokens`` must be set."""
        pred, depth = self._estimate(b, req, now, fleet, depth)
        return pred.e2e, depth

    def _estimate(self, b: Backend, req: RequestInfo, now: float, fleet: float, depth: int | None = None) -> tuple[Prediction, int]:
        """b's predicted TTFT and end-to-end latency for r, and the prefix depth b holds for r."""
        m = self._model(b)
        if depth is None:
            depth = m.prefixes.depth(req.prefix_keys, now) if req.prefix_keys else 0
        sigma = self.sigma(b, fleet)
        g = self.gamma
        d = req.out_tokens
        n = m.batch()
        step = sigma * (1.0 + g * n)
        rho = self.rho  # a property: once per estimate, not once per request in flight
        # rems: (output tokens left, KV held) of each of ours, needed only for _wait_steps: nothing to wait
        # for without known slots or KV capacity. One pass over those in flight, for every candidate of every pick.
        below = req.priority if self.OTHERS_WEIGHT else None
        queued, rems, shared, low_shared, low_n = self._progress(m, now, step, sigma, rho, d, below, m.slots is not None or m.kv_capacity is not None)
        sizes = self._sizes(req.model)
        # Others' sequences on b: the other gateway replicas' (the load exchange, 50 ms old at most)
        # and what its /metrics shows beyond every replica's. The replicas say what their requests
        # have left to decode and to prefill; the rest count at half the mean output, 10% of them in prefill.
        ext = m.ext + b.remote_in_flight
        others_seq: list[tuple[float, float]] = []  # (output tokens left, KV held) of each of the others
        if ext:
            ext_rem = sizes.out_avg / 2
            told = b.remote_in_flight if b.remote_kv > 0 else 0
            if told:
                each = b.remote_decode / told
                shared += told * (each if each < d else d)
                queued += b.remote_prefill
                others_seq = [(each, b.remote_kv / told)] * told
            rest = ext - told
            if rest:
                shared += rest * (ext_rem if ext_rem < d else d)
                queued += rest * sizes.prompt(req) * 0.1  # some of the others are in prefill; a rough share
                others_seq += [(ext_rem, 0.0)] * int(rest)
        prompt = sizes.prompt(req)
        uncached = max(0.0, prompt - key_tokens(depth))
        prefill = rho * sigma * (queued + uncached)
        lat = prefill + sigma * (1.0 + g) * d + sigma * g * shared
        wait = self._wait_steps(m, rems, prompt + d, others_seq, b.remote_kv)
        wait_s = wait * step
        lat += wait_s
        others = self.OTHERS_WEIGHT
        if others and m.slots is not None and self.OTHERS_LOAD:
            # A batch near its slots refills as soon as a sequence leaves: the longer r holds a slot
            # there, the more later arrivals wait for one or share its steps. u/(1-u) is the mean
            # queue of a server busy u of the time; capped, as W_b and the queue term below count
            # a full batch themselves.
            u = min(self.MAX_LOAD, (len(m.inflight) + ext + 1) / m.slots)
            others *= 1.0 + self.OTHERS_LOAD * u / (1.0 - u)
        if others:
            o_shared, o_n = shared, n
            if low_n:
                # Only the others of r's class or above count: a lower class's sequences (a batch
                # flood) do not push an interactive request onto fewer backends to spare them.
                o_shared -= low_shared
                o_n = max(0.0, n - low_n)
            # What r costs the requests already there: σγ more per step they share, and, when the
            # batch is full, its decode time spread over the slots for each one queued behind it.
            lat += others * sigma * g * o_shared
            # r's prefill runs inside a step of the whole batch: every sequence decoding there waits
            # for it. A prefix-cache hit is worth this much to the others, not just to r.
            lat += others * rho * sigma * uncached * min(o_n, m.slots or o_n)
            behind = len(m.inflight) + 1 - m.slots if m.slots is not None else 0
            if behind > 0:
                lat += others * behind * d * step / m.slots
        # The first token comes after the wait for a slot (the prefill queue drains meanwhile), r's
        # own prefill and one step.
        ttft = max(wait_s, rho * sigma * queued) + rho * sigma * uncached + step
        ramp = min(1.0, self._ramp(b, now) / self._top)
        lat /= ramp
        ttft /= ramp
        sig = m.signals
        if sig is not None and self.KV_PENALTY and sig.fresh(now) and m.slots is None:
            k = min(sig.kv_usage, 0.99)
            pen = self.KV_PENALTY * k / (1.0 - k)
            lat += pen
            ttft += pen
        free = m.slots - len(m.inflight) - ext if m.slots is not None else float("inf")
        kv_free = None
        if m.kv_capacity:
            # What r and every sequence on b hold: ours and the other replicas' as counted, the rest at the mean request size.
            known = b.remote_in_flight if b.remote_kv > 0 else 0
            held = m.kv + b.remote_kv + max(0.0, ext - known) * sizes.tokens_avg + prompt + d
            kv_free = 1.0 - held / m.kv_capacity
        return Prediction(ttft=ttft, e2e=lat, wait=wait_s / ramp, slots=m.slots, free=free, prefill_ahead=rho * sigma * queued / ramp,
                          kv_free=kv_free), depth

    def predict(self, candidates: Sequence[Backend], req: RequestInfo) -> list[Prediction]:
        """What each candidate would do with r if it were sent now."""
        self._prepare(req)
        now = self.clock()
        fleet = self.fleet_sigma(candidates)
        self._ramp_top(candidates, now)
        est = [self._estimate(b, req, now, fleet) for b in candidates]
        self._memo = (req, candidates, fleet, est)
        return [p for p, _ in est]

    def starts_at_once(self, backend: Backend, req: RequestInfo) -> bool:
        # The conditions under which _wait_steps is 0 for r (so _estimate's wait is 0), checked
        # without walking the requests in flight: a free batch slot (or none known) and KV room
        # (or no capacity known), with the same arithmetic as there.
        m = self._model(backend)
        if m.slots is not None and len(m.inflight) + int(m.ext + backend.remote_in_flight) + 1 > m.slots:
            return False
        if m.kv_capacity is not None and (m.inflight or backend.remote_kv > 0):
            self._prepare(req)
            if m.kv + backend.remote_kv + (self._sizes(req.model).prompt(req) + req.out_tokens) - m.kv_capacity > 0:
                return False
        return True

    def _progress(self, m: BackendModel, now: float, step: float, sigma: float, rho: float, d: float = math.inf, below: int | None = None,
                  keep: bool = True) -> tuple[float, list[tuple[float, float]], float, float, int]:
        """(uncached prompt tokens of b's requests still in prefill, (output tokens left, KV held) of each of ours
        (with ``keep``), Σ min(left, d) over ours, and that sum and count over those of a class below ``below``)."""
        queued = shared = low_shared = 0.0
        low_n = 0
        rems: list[tuple[float, float]] = []
        rs = rho * sigma  # (rho * sigma) * x, as written out before: the same rounding
        for j in m.inflight.values():
            if j.first_byte_at:
                decoded = (now - j.first_byte_at) / step
            elif j.stream:
                queued += j.uncached
                decoded = 0.0
            else:  # a non-streamed response shows no first byte: assume its prefill took the estimate
                t = now - j.dispatched_at - rs * j.prefill_ahead
                if t < 0:
                    queued += j.uncached
                decoded = t / step if t > 0 else 0.0
            rem = j.out_tokens - decoded
            if rem < 1.0:
                rem = 1.0
            part = rem if rem < d else d
            shared += part
            if below is not None and j.priority is not None and j.priority < below:
                low_shared += part
                low_n += 1
            if keep:
                rems.append((rem, j.kv_tokens))
        return queued, rems, shared, low_shared, low_n

    def shared_load(self, backend: Backend) -> tuple[float, float, float]:
        m = self.models.get(backend)
        if m is None or not m.inflight:
            return 0.0, 0.0, 0.0
        sigma = self.sigma(backend, self._fleet)
        queued, _, left, _, _ = self._progress(m, self.clock(), sigma * (1.0 + self.gamma * m.batch()), sigma, self.rho, keep=False)
        return m.kv, left, queued

    @staticmethod
    def _wait_steps(m: BackendModel, rems: list[tuple[float, float]], kv_new: float, others: Sequence[tuple[float, float]] = (),
                    others_kv: float = 0.0) -> float:
        """Decode steps until r is admitted: a batch slot and room for its KV must both free up.
        ``others``: (output tokens left, KV held) of each sequence on b that is not ours (they take slots
        too); ``others_kv``: the KV they hold between them, where known (the other replicas')."""
        wait = 0.0
        if m.slots is not None and len(rems) + len(others) + 1 > m.slots:
            ahead = rems + list(others) if others else rems
            wait = heapq.nsmallest(len(ahead) + 1 - m.slots, ahead)[-1][0]
        if m.kv_capacity is not None and (rems or others_kv):
            need = m.kv + others_kv + kv_new - m.kv_capacity
            if need > 0:
                freed = 0.0
                for rem, kv in sorted(rems + list(others) if others_kv else rems):  # the first to finish free their KV first
                    freed += kv
                    if freed >= need:
                        break
                wait = max(wait, rem)
        return wait

    def explain(self, candidates: Sequence[Backend], req: RequestInfo) -> dict[str, tuple[float, int]]:
        """Each candidate's (expected latency, prefix depth) for ``req``: for tests and debugging."""
        now = self.clock()
        self._prepare(req)
        fleet = self.fleet_sigma(candidates)
        self._ramp_top(candidates, now)
        return {b.id: self.expected_latency(b, req, now, fleet) for b in candidates}

    def _prepare(self, req: RequestInfo) -> None:
        sizes = self._sizes(req.model)
        req.out_tokens = sizes.output(req)

    # -- the interface ----------------------------------------------------------------------------
    def pick(self, candidates: Sequence[Backend], req: RequestInfo) -> Backend:
        self.picks += 1
        self._prepare(req)
        if len(candidates) == 1:
            req.picked = (None, 0)
            return candidates[0]
        fleet = self._fleet = self.fleet_sigma(candidates)
        memo, self._memo = self._memo, None
        if memo is not None and memo[0] is req and memo[1] is candidates and memo[2] == fleet:
            # The queue's predict for this request and these backends, nothing learnt or sent since (the
            # same synchronous admission, microseconds earlier): the same estimates, not made twice.
            preds = [(p, depth, b) for (p, depth), b in zip(memo[3], candidates)]
        else:
            now = self.clock()
            self._ramp_top(candidates, now)
            preds = [(*self._estimate(b, req, now, fleet), b) for b in candidates]
        # (score, prefix depth, backend). The person waits for the first token, then reads as it
        # streams: TTFT weighs extra.
        w = self.TTFT_WEIGHT
        scored = [(p.e2e + w * p.ttft, depth, b) for p, depth, b in preds]
        best_lat = min(s[0] for s in scored)
        tol = 1e-9 * abs(best_lat)
        ties = [s for s in scored if s[0] <= best_lat + tol]
        choice = ties[0] if len(ties) == 1 else self.rng.choice(ties)
        bound = self.AFFINITY_BOUND
        if bound > 0 and req.prefix_keys:
            aff = max(scored, key=lambda s: (s[1], -s[0]))
            if aff[1] > choice[1] and key_tokens(aff[1]) >= self.AFFINITY_MIN_TOKENS and aff[0] <= best_lat * (1.0 + bound):
                if aff[2] is not choice[2]:
                    self.affinity_picks += 1
                    AFFINITY_PICKS.inc()
                choice = aff
        req.picked = (choice[2], choice[1])
        return choice[2]

    def dispatched(self, backend: Backend, req: RequestInfo) -> None:
        self._memo = None
        backend.in_flight += 1
        now = self.clock()
        m = self._model(backend)
        m.advance(now)
        if not req.out_tokens:
            self._prepare(req)
        picked, depth = req.picked
        if picked is not backend:
            depth = m.prefixes.depth(req.prefix_keys, now) if req.prefix_keys else 0
        req.picked = (None, 0)
        prompt = self._sizes(req.model).prompt(req)
        req.uncached = max(0.0, prompt - key_tokens(depth))
        req.kv_tokens = prompt + req.out_tokens
        m.kv += req.kv_tokens
        req.prefill_ahead = (m.prefilling if m.prefilling > 0.0 else 0.0) + req.uncached  # (rounding may leave -1e-13)
        m.prefilling += req.uncached
        req.dispatched_at = now
        req.first_byte_at = 0.0
        req.area_at = m.area
        m.inflight[id(req)] = req
        if len(m.inflight) > m.if_max:
            m.if_max = len(m.inflight)
        # Every prompt enters b's prefix cache, a shared one or not: with the room known, the memory
        # drops what the engine's LRU would.
        m.prefixes.add(req.prefix_keys, now, prompt, self._room(backend, m, req.model))
        if req.prefix_keys and self.placements is not None:
            self.placements.record(backend.id, req.prefix_keys, int(prompt))

    def first_byte(self, backend: Backend, req: RequestInfo, ttft: float) -> bool:
        self._memo = None
        m = self._model(backend)
        if id(req) not in m.inflight or not req.stream:
            return False  # a non-streamed response's first byte is its end
        now = self.clock()
        m.advance(now)
        if not req.first_byte_at and now:
            m.prefilling -= req.uncached
        req.first_byte_at = now
        req.area_at = m.area
        sigma = self.sigma(backend, self._fleet)
        freed = False
        if m.slots is None and ttft > 0:
            self._learn_slots(m, req, ttft, sigma, now, m.ext + float(backend.remote_in_flight))  # ext no longer holds the replicas'
        elif m.ext > 0.0 and ttft > 0 and self._late(m, req, ttft, sigma) <= 0.0:
            freed = self._bound_external(m, req, sigma, backend.remote_in_flight)
        if req.prefill_ahead > 0 and ttft > 0:
            # Seconds of prefill per token per σ: TTFT less one decode step.
            prefill = max(0.0, ttft - sigma * (1.0 + self.gamma * m.batch()))
            self._rho_num = self.DECAY * self._rho_num + prefill / sigma
            self._rho_den = self.DECAY * self._rho_den + req.prefill_ahead
        return freed

    def _late(self, m: BackendModel, req: RequestInfo, ttft: float, sigma: float) -> float:
        """How much later than its prefill and a few decode steps r's first byte came (> 0: it may
        have waited in the engine's queue; <= 0: it joined the batch at once)."""
        step = sigma * (1.0 + self.gamma * m.batch())
        return ttft - 2.0 * self.rho * sigma * req.prefill_ahead - step - self.LATE_STEPS * step

    def _bound_external(self, m: BackendModel, req: RequestInfo, sigma: float, remote: int) -> bool:
        """r joined the batch at once. If ours sent before it, the other replicas' and the gauges'
        others (``ext``) filled every slot, the gauges are out of date: they are a snapshot up to 10 s
        old, and on the H200 direct clients' load that had ended stayed in them, the backend looked
        full, the queue let one request at a time through for 8 s and shed 53 of 96 on a wait it
        predicted from that trickle. Then ``ext`` is at most what left a slot for r, and half of that:
        one contradicted claim makes the rest doubtful, the half leaves the queue room to send more,
        and a few starts at once clear it (a real load beside ours shows again in the next snapshot;
        until then, at worst, a few requests wait in the engine instead of here)."""
        step = sigma * (1.0 + self.gamma * m.batch())
        t0 = req.dispatched_at
        ours = sum(1 for j in m.inflight.values() if j.first_byte_at or j.dispatched_at <= t0)
        freed = sum(1 for t in m.done if t >= t0 - step)  # finished as r was sent: their slots were free
        if m.slots is None or ours + remote + m.ext - freed <= m.slots:
            return False  # the claim left r a slot: nothing contradicts it
        m.ext = 0.5 * max(0.0, min(float(m.slots - ours - remote + freed), m.ext))
        return True

    def _learn_slots(self, m: BackendModel, req: RequestInfo, ttft: float, sigma: float, now: float, ext: float) -> None:
        """A first byte that comes well after r's prefill (counted at twice the prediction, as ρ is
        learnt from these same TTFTs) waited in the engine's queue: the batch was full when r joined
        it. The engine admits in order, so the batch is then every one of ours that has started or was
        sent before r, the others' sequences, and those that finished in the step that admitted r.
        Two such counts that agree set the slots; the gauges, 10 s apart, show a queue much later
        (in the replay 40 s into a 60-s trace on the fastest backend) or not at all. Not while the
        KV cache is nearly full: then it may be KV room, not a slot, that r waited for. Nor when the
        gateway's own event loop ran about as late (``LoopLag``): a CPU-saturated gateway in front of an
        instant backend learnt 3-5 slots from its own delays, then walked every request in flight per
        admission and would have held requests back for a batch that did not exist."""
        # Not gated on b's own speed history: waiting for 3 completions (the replay's mixed runs learnt 5-11
        # of 32 slots 1-3 s in without it) left the slots unknown on sockets, the sims queued requests past
        # 32, γ was fitted from those waits (0.18-0.43 against 0.07-0.08) and TTFT p99 at 80 % went from
        # 0.77-0.83 to 1.27-2.22 s (bench/routing/README.md of 227c192, seventh pass).
        step = sigma * (1.0 + self.gamma * m.batch())
        self.lag.arm()
        late = self._late(m, req, ttft, sigma)
        if late <= 0.0:
            return  # not late
        if late <= self.LAG_MARGIN * self.lag.lag():
            self.lag_vetoes += 1
            return  # no later than the gateway's own event loop made it
        if m.kv_capacity is not None and m.kv >= 0.8 * m.kv_capacity or m.signals is not None and m.signals.kv_usage >= 0.8:
            return
        if not all(j.stream for j in m.inflight.values()):
            return  # a non-streamed request shows no first byte: which of them run is not known
        t0 = req.dispatched_at
        batch = sum(1 for j in m.inflight.values() if j.first_byte_at or j.dispatched_at <= t0)
        batch += int(ext) + sum(1 for t in m.done if now - t < 0.5 * step)
        if batch == m.full_at:
            m.slots = batch
            m.slots_at = now
        m.full_at = batch

    def completed(self, backend: Backend, req: RequestInfo, outcome: Outcome) -> None:
        self._memo = None
        m = self._model(backend)
        if id(req) not in m.inflight:
            return  # already completed: never count a request twice
        now = self.clock()
        m.advance(now)  # the batch integral still counts this request up to now
        del m.inflight[id(req)]
        m.done.append(now)
        if len(m.done) > 8:
            del m.done[0]
        m.kv = max(0.0, m.kv - req.kv_tokens) if m.inflight else 0.0
        m.prefilling = (m.prefilling - req.uncached if not req.first_byte_at else m.prefilling) if m.inflight else 0.0
        backend.in_flight -= 1
        if outcome.ok:
            self._sizes(req.model).learn(req, outcome)
            self._learn_speed(backend, m, req, outcome, now)

    def _learn_speed(self, b: Backend, m: BackendModel, req: RequestInfo, outcome: Outcome, now: float) -> None:
        k = outcome.completion_tokens
        if k is None or k < 2:
            return
        if req.first_byte_at:
            start = req.first_byte_at
        else:
            start = req.dispatched_at + self.rho * self.sigma(b, self._fleet) * req.prefill_ahead
        span = now - start
        if span <= 0:
            return
        y = span / (k - 1)  # seconds per output token
        nbar = max(1.0, (m.area - req.area_at) / (now - (req.first_byte_at or req.dispatched_at)))
        self._add_speed(m, y, nbar)
        self._fit_gamma()
        if self.placements is not None:
            self.placements.observe(b.id, y, nbar)  # the other replicas learn from it too (learn_speeds)

    def learn_speeds(self, backend: Backend, observations: Sequence[tuple[float, float]]) -> None:
        # Another replica's completions on b, as if ours: with N replicas each one otherwise fits σ and
        # γ from 1/N of the completions (bench/routing/README.md of 227c192, replicas: TTFT p99 +11 % on 30-s
        # traces with 4). Folded into the same decayed sums, so a replica that stops (or dies) weighs
        # less with every later completion, as an old one of ours does.
        self._memo = None
        m = self._model(backend)
        for y, nbar in observations:
            self._add_speed(m, y, nbar)
        self._fit_gamma()

    def _add_speed(self, m: BackendModel, y: float, nbar: float) -> None:
        lam = self.DECAY
        m.w = lam * m.w + 1.0
        m.sn = lam * m.sn + nbar
        m.sy = lam * m.sy + y
        f = m.fit
        lam = self.FIT_DECAY
        f[0] = lam * f[0] + 1.0
        f[1] = lam * f[1] + nbar
        f[2] = lam * f[2] + nbar * nbar
        f[3] = lam * f[3] + y
        f[4] = lam * f[4] + nbar * y

    def _fit_gamma(self) -> None:
        """γ: each backend's least-squares line y = a + c·n̄, pooled as c/a weighted by the spread of
        its n̄ (a backend always at the same batch says nothing about the slope), plus a prior."""
        num = self.GAMMA0 * self.GAMMA_PRIOR
        den = self.GAMMA_PRIOR
        for m in self.models.values():
            w, sn, snn, sy, sny = m.fit
            if w < 5.0:
                continue
            sxx = snn - sn * sn / w
            if sxx <= 1e-9:
                continue
            c = (sny - sn * sy / w) / sxx
            a = (sy - c * sn) / w
            if a <= 0.0:
                continue
            num += sxx * min(1.0, max(0.0, c / a))
            den += sxx
        self.gamma = num / den

    def observe_signals(self, backend: Backend, signals: Signals, changed: bool) -> None:
        self._memo = None
        m = self._model(backend)
        m.signals = signals
        m.advance(self.clock())
        if changed:
            seen = signals.running + signals.waiting
            # Beyond the most that this and the other replicas had there since the last scrape: the
            # gauges are up to 10 s old, and counting the replicas' requests from them (instead of
            # the exchange's fresh count) held a burst's load on a backend for seconds after it left.
            m.ext = max(0.0, seen - m.if_max - m.remote_max)
            slots = m.slots
            m.slots = learn_slots(m.slots, signals)
            if slots is None and m.slots is not None:
                m.slots_at = self.clock()
            if signals.kv_usage >= 0.2 and m.kv + backend.remote_kv > 0:
                # The KV the admitted requests hold (ours, and the other replicas' as they report it) over
                # the usage the gauge shows: without theirs, N replicas each learnt about 1/N of the cache.
                # Admission is in order, so the newest `waiting` of ours are the ones not admitted (the
                # others' share of the queue in proportion). The gauge is up to a refresh old, hence the smoothing.
                held = m.kv + backend.remote_kv
                queued = int(signals.waiting)
                if queued:
                    remote = backend.remote_in_flight if backend.remote_kv > 0 else 0
                    ours = queued if not remote else round(queued * len(m.inflight) / (len(m.inflight) + remote))
                    held -= sum(j.kv_tokens for j in itertools.islice(reversed(m.inflight.values()), ours))
                    if remote:
                        held -= backend.remote_kv * min(1.0, (queued - ours) / remote)
                if held > 0:
                    cap = held / signals.kv_usage
                    m.kv_capacity = cap if m.kv_capacity is None else 0.7 * m.kv_capacity + 0.3 * cap
        if not signals.fresh(self.clock()):
            m.ext = 0.0
        m.if_max = len(m.inflight)
        m.remote_max = m.remote
