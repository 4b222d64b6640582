"""PD scenario: prefill/decode disaggregation against hybrid serving, same simulated GPUs, one run.

    python -m bench.routing.pd --quick      # 4 simulated GPUs, 20 s per mode: about 1.5 min
    python -m bench.routing.pd              # 60 s per mode

Each mode is one gateway (`gateway serve`) that launches its own simulators (launch groups,
`engine: sim`): hybrid = N instances; PD = N/2 prefill + N/2 decode (`models.<m>.serving:
distserve`). The same seeded open-loop trace goes through both: Poisson arrivals of long, distinct
prompts (no prefix reuse), streamed outputs. Reported per mode: time to first token and time
between tokens (every gap between two streamed tokens), p50 and p99.

Why the two differ (the sim's cost model, gateway/sim/engine.py): an engine step costs the prefill
of the prompts admitted in it plus one decode pass, so on a hybrid instance every long prompt that
arrives stalls the tokens of all sequences running there; a decode instance receives the KV by
migration and never prefills, while prefill instances never decode.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import orjson
import yaml

from .fleet import _Proc, free_port

MODEL = "pd-bench"
# Slower than a GPU like the routing bench's sims, so a 2-core machine can relay the frames.
SIM = {"ttft": 0.005, "tpot": 0.03, "prefill_tokens_per_s": 8000, "batch_slowdown": 0.02, "kv_capacity_tokens": 400_000}
CHARS_PER_TOKEN = 4  # the simulator's tokenizer (gateway/sim/tokens.py)


class GatewayWithSims(_Proc):
    def __init__(self, workdir: Path, mode: str, gpus: int, max_batch_size: int = 64):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        group = {"model": "sim/pd-bench", "model_name": MODEL, "engine": "sim", "backend": "pytorch", "sim": SIM, "max_batch_size": max_batch_size}
        if mode == "hybrid":
            launch = [{**group, "instances": gpus}]
            models: dict = {}
        else:
            launch = [{**group, "role": "prefill", "instances": gpus // 2}, {**group, "role": "decode", "instances": gpus - gpus // 2}]
            models = {MODEL: {"serving": "distserve"}}
        config = {
            "auth": {"disabled": True},
            "launch": launch,
            "models": models,
            "health": {"interval": 1.0, "timeout": 2.0},
            "server": {"host": "127.0.0.1", "port": self.port, "log_level": "warning"},
        }
        path = workdir / f"gateway-{mode}.yaml"
        path.write_text(yaml.safe_dump(config))
        super().__init__([sys.executable, "-m", "gateway", "serve", "--config", str(path)], f"gateway ({mode})")
        self._wait(lambda: httpx.get(self.url + "/ready", timeout=2).json().get("healthy_backends") == gpus, 60)


@dataclass
class Trace:
    at: list[float] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    max_tokens: int = 48


def make_trace(seed: int, rate: float, duration: float, prompt_tokens: tuple[int, int]) -> Trace:
    rng = random.Random(seed)
    t, trace = 0.0, Trace()
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "lambda"]
    while t < duration:
        t += rng.expovariate(rate)
        n = rng.randint(*prompt_tokens)
        head = f"request {len(trace.at)} seed {seed}: "  # distinct from the first block: no prefix reuse
        body = " ".join(rng.choice(words) for _ in range(n * CHARS_PER_TOKEN // 6 + 1))
        trace.at.append(t)
        trace.prompts.append(head + body)
    return trace


@dataclass
class Sample:
    ok: bool
    ttft: float | None
    gaps: list[float]


async def one(session: aiohttp.ClientSession, url: str, at: float, prompt: str, max_tokens: int, start: float) -> Sample:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start + at - loop.time()))
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    t0 = loop.time()
    last = None
    ttft = None
    gaps: list[float] = []
    ok = False
    try:
        async with session.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers={"content-type": "application/json"}) as r:
            buf = b""
            async for chunk in r.content.iter_any():
                now = loop.time()
                buf += chunk
                frames = buf.count(b'"content"')  # one token per frame with content
                buf = buf[buf.rfind(b"\n\n") + 2 :] if b"\n\n" in buf else buf
                for _ in range(frames):
                    if ttft is None:
                        ttft = now - t0
                    elif last is not None:
                        gaps.append(now - last)
                    last = now
                if b"[DONE]" in chunk:
                    ok = r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        ok = False
    return Sample(ok, ttft, gaps)


async def run_trace(url: str, trace: Trace) -> list[Sample]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = asyncio.get_running_loop().time() + 0.2
        return await asyncio.gather(*(one(session, url, at, p, trace.max_tokens, start) for at, p in zip(trace.at, trace.prompts)))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing.pd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 s per mode instead of 60")
    ap.add_argument("--gpus", type=int, default=4, help="simulated GPUs per mode (PD splits them half prefill, half decode)")
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-batch-size", type=int, default=64, help="batch slots of every instance; small, the decode instances' slots bind before their KV")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(2000, 6000), metavar=("MIN", "MAX"))
    args = ap.parse_args(argv)
    duration = 20.0 if args.quick else 60.0
    trace = make_trace(args.seed, args.rate, duration, tuple(args.prompt_tokens))
    print(f"PD bench: seed {args.seed}, {args.gpus} simulated GPUs per mode, {len(trace.at)} requests over {duration:g} s "
          f"({args.rate:g} req/s), {args.max_batch_size} batch slots per instance, prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, {trace.max_tokens} output tokens, streamed")
    print(f"sim: {SIM}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        for mode in ("hybrid", "pd"):
            gw = GatewayWithSims(Path(tmp), mode, args.gpus, args.max_batch_size)
            try:
                t0 = time.monotonic()
                samples = asyncio.run(run_trace(gw.url, trace))
                wall = time.monotonic() - t0
            finally:
                gw.stop()
            skip = len(samples) // 10  # warm-up
            kept = samples[skip:]
            ttfts = [s.ttft for s in kept if s.ttft is not None]
            gaps = [g for s in kept for g in s.gaps]
            errors = sum(1 for s in samples if not s.ok)
            rows.append((mode, pct(ttfts, 0.5), pct(ttfts, 0.99), pct(gaps, 0.5), pct(gaps, 0.99), statistics.fmean(gaps) if gaps else float("nan"), errors, wall))
    label = {"hybrid": f"hybrid ({args.gpus})", "pd": f"PD ({args.gpus // 2}P+{args.gpus - args.gpus // 2}D)"}
    print(f"\n{'mode':<14}{'ttft p50':>10}{'ttft p99':>10}{'tbt p50':>10}{'tbt p99':>10}{'tbt mean':>10}{'errors':>8}{'wall s':>8}   seconds")
    base = rows[0]
    for mode, t50, t99, g50, g99, gmean, err, wall in rows:
        note = "" if mode == "hybrid" else f"   tbt p99 {100 * (g99 / base[4] - 1):+.0f}%, ttft p50 {100 * (t50 / base[1] - 1):+.0f}% vs hybrid"
        print(f"{label[mode]:<14}{t50:>10.3f}{t99:>10.3f}{g50:>10.4f}{g99:>10.4f}{gmean:>10.4f}{err:>8}{wall:>8.1f}{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
