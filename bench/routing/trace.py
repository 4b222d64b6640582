"""The seeded open-loop workload: Poisson arrivals, long-tailed lengths, a share of shared prefixes.

Every policy replays the same ``Trace`` (same seed, same arrivals, same bodies). Lengths are in
simulator tokens (4 characters each). The time and token scales are shrunk so a 2-core machine
can run a fleet: see ``SimParams`` for the factors.
"""

from __future__ import annotations

import math
import random
import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SimParams:
    """One simulated api_server at --speed 1, scaled from LMDeploy on one GPU.

    Real: decode step ~5 ms at batch 1, prefill ~20k tok/s. Here every time is 10x longer (tpot
    50 ms, prefill 2,000 tok/s) and outputs ~10x shorter, so a request lasts about as long as a
    real one while the machine relays ~10x fewer SSE frames. The gauges still refresh every 10 s,
    as in LMDeploy.
    """

    tpot: float = 0.05
    ttft: float = 0.02
    prefill_tokens_per_s: float = 2000.0
    batch_slowdown: float = 0.03  # a step at batch 32 takes 1.96x a lone step
    max_batch_size: int = 32
    kv_capacity_tokens: int = 16_000  # small enough that 16 documents do not all stay cached everywhere
    block_tokens: int = 16
    metrics_interval: float = 10.0

    def argv(self, speed: float, record_limit: int = 0) -> list[str]:
        """``record_limit``: requests each sim keeps in its log (0: none, the bench's cost; ``--dump`` needs them)."""
        return [
            "--speed", str(speed),
            "--tpot", str(self.tpot),
            "--ttft", str(self.ttft),
            "--prefill-tokens-per-s", str(self.prefill_tokens_per_s),
            "--batch-slowdown", str(self.batch_slowdown),
            "--max-batch-size", str(self.max_batch_size),
            "--kv-capacity-tokens", str(self.kv_capacity_tokens),
            "--block-size", str(self.block_tokens),
            "--metrics-interval", str(self.metrics_interval),
            "--record-limit", str(record_limit),
        ]

    def seconds_per_request(self, prompt_tokens: float, output_tokens: float) -> float:
        """Engine time one request costs a full batch at speed 1: its prefill plus its share of the steps."""
        b = self.max_batch_size
        return prompt_tokens / self.prefill_tokens_per_s + output_tokens * self.tpot * (1 + b * self.batch_slowdown) / b


@dataclass(frozen=True, slots=True)
class Item:
    at: float  # seconds after the start
    body: dict
    prompt_tokens: int
    output_tokens: int
    shared: bool  # starts with one of the shared documents
    document_tokens: int = 0
    key: str = ""  # the API key's name that sends it (mixed-priority runs); "" without authentication


@dataclass
class Trace:
    items: list[Item]
    rate: float  # requests per second
    duration: float
    mean_prompt: float = 0.0
    mean_output: float = 0.0
    meta: dict = field(default_factory=dict)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta", "rho", "tau")


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` simulator tokens (4 chars each) of filler words."""
    chars = tokens * 4
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def lengths(rng: random.Random) -> tuple[int, int]:
    """(question, output) tokens: log-normal, long-tailed (p99 about 10x the median)."""
    return _lognormal(rng, 40, 1.0, 4, 1500), _lognormal(rng, 24, 1.0, 2, 400)


def make_trace(
    seed: int,
    *,
    rate: float,
    duration: float,
    model: str,
    shared_share: float = 0.5,
    documents: int = 16,
    document_tokens: tuple[int, int] = (150, 450),
) -> Trace:
    """Poisson arrivals at ``rate`` for ``duration`` s. ``shared_share`` of requests open with one of
    ``documents`` long system prompts (Zipf popularity) and then ask their own question."""
    rng = random.Random(seed)
    docs = [f"[doc {d}] " + _text(rng, rng.randint(*document_tokens)) for d in range(documents)]
    weights = [1.0 / (i + 1) ** 0.8 for i in range(documents)]  # Zipf-like popularity
    items: list[Item] = []
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        p, d = lengths(rng)
        question = f"[q {seed}-{i}] " + _text(rng, p)
        shared = rng.random() < shared_share
        messages = []
        prompt_tokens = p
        doc_tokens = 0
        if shared:
            doc = rng.choices(docs, weights)[0]
            messages.append({"role": "system", "content": doc})
            doc_tokens = len(doc) // 4
            prompt_tokens += doc_tokens
        messages.append({"role": "user", "content": question})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": d,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        items.append(Item(at=t, body=body, prompt_tokens=prompt_tokens, output_tokens=d, shared=shared, document_tokens=doc_tokens))
        i += 1
    n = max(1, len(items))
    return Trace(
        items=items,
        rate=rate,
        duration=duration,
        mean_prompt=sum(x.prompt_tokens for x in items) / n,
        mean_output=sum(x.output_tokens for x in items) / n,
    )


def fleet_capacity(params: SimParams, speeds: list[float], seed: int, model: str, shared_share: float) -> float:
    """Requests per second the fleet finishes at full batches when prefix caches work: the shared
    documents are prefilled once, every question in full."""
    probe = make_trace(seed, rate=50.0, duration=200.0, model=model, shared_share=shared_share)
    questions = sum(x.prompt_tokens - x.document_tokens for x in probe.items) / len(probe.items)
    per_request = params.seconds_per_request(questions, probe.mean_output)
    return sum(speeds) / per_request


def mixed_trace(seed: int, *, interactive_rate: float, batch_rate: float, duration: float, model: str) -> Trace:
    """An interactive stream of short requests (key ``ui``) plus a batch flood (key ``bulk``, the
    usual length mix, arriving in bursts of 20 at ``batch_rate`` on average)."""
    rng = random.Random(seed * 7919 + 1)
    ui = make_trace(seed, rate=interactive_rate, duration=duration, model=model)
    items = []
    for it in ui.items:
        out = min(it.output_tokens, 16)
        body = {**it.body, "max_tokens": out}
        items.append(dataclasses.replace(it, body=body, output_tokens=out, key="ui"))
    if batch_rate > 0:
        bulk = make_trace(seed + 1000, rate=batch_rate, duration=duration, model=model)
        burst_at = 0.0
        for j, it in enumerate(bulk.items):
            if j % 20 == 0:
                burst_at = it.at + rng.uniform(0, 1)
            items.append(dataclasses.replace(it, at=min(duration, burst_at + 0.01 * (j % 20)), key="bulk"))
    items.sort(key=lambda x: x.at)
    n = max(1, len(items))
    return Trace(items=items, rate=interactive_rate + batch_rate, duration=duration,
                 mean_prompt=sum(x.prompt_tokens for x in items) / n, mean_output=sum(x.output_tokens for x in items) / n)
