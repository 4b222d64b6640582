"""PD scenario: prefill/decode disaggregation against hybrid serving, same simulated GPUs, one run.

    python -m bench.routing.pd --quick      # 4 simulated GPUs, 20 s per mode: about 1.5 min
    python -m bench.routing.pd              # 60 s per mode
    python -m bench.routing.pd --mixed      # PD only: interactive TTFT alone and beside a batch flood

Each mode is one gateway (`gateway serve`) that launches its own simulators (launch groups,
`engine: sim`): hybrid = N instances; PD = N/2 prefill + N/2 decode (`models.<m>.serving:
distserve`). The same seeded open-loop trace goes through both: Poisson arrivals of long, distinct
prompts (no prefix reuse), streamed outputs. Reported per mode: time to first token and time
between tokens (every gap between two streamed tokens), p50 and p99.

Why the two differ (the sim's cost model, gateway/sim/engine.py): an engine step costs the prefill
of the prompts admitted in it plus one decode pass, so on a hybrid instance every long prompt that
arrives stalls the tokens of all sequences running there; a decode instance receives the KV by
migration and never prefills, while prefill instances never decode.

``--mixed`` (issue 13's priorities in PD mode): PD only, two runs with a fresh gateway each. Key
``ui`` (interactive) sends short requests (``--ui-prompt-tokens``, 16 output tokens) at ``--ui-load``
of the prefill instances' capacity (their prefill tokens per second); alone, then beside key
``bulk`` (batch), the long prompts at ``--bulk-load`` in bursts of 20 (as ``bench.routing --mixed``).
Reported: ui TTFT p50/p99 alone and beside the flood, refusals (shed) per key, bulk completions;
``--repeat`` and ``--seeds`` run each phase several times and add the mean, range and pooled p99.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
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
from .run import KEYS, balancer_config

MODEL = "pd-bench"
# Slower than a GPU like the routing bench's sims, so a 2-core machine can relay the frames.
SIM = {"ttft": 0.005, "tpot": 0.03, "prefill_tokens_per_s": 8000, "batch_slowdown": 0.02, "kv_capacity_tokens": 400_000}
CHARS_PER_TOKEN = 4  # the simulator's tokenizer (gateway/sim/tokens.py)


class GatewayWithSims(_Proc):
    def __init__(self, workdir: Path, mode: str, gpus: int, max_batch_size: int = 64, keys: dict[str, tuple[str, str]] | None = None, balancer: dict | None = None):
        """keys: name -> (secret, priority class), as the routing bench's; without, authentication is off."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        group = {"model": "sim/pd-bench", "model_name": MODEL, "engine": "sim", "backend": "pytorch", "sim": SIM, "max_batch_size": max_batch_size}
        if mode == "hybrid":
            launch = [{**group, "instances": gpus}]
            models: dict = {}
        else:
            launch = [{**group, "role": "prefill", "instances": gpus // 2}, {**group, "role": "decode", "instances": gpus - gpus // 2}]
            models = {MODEL: {"serving": "distserve"}}
        auth: dict = {"disabled": True}
        if keys:
            auth = {"keys": [{"name": n, "hash": "sha256:" + hashlib.sha256(k.encode()).hexdigest(), "priority": p} for n, (k, p) in keys.items()]}
        config = {
            "auth": auth,
            "launch": launch,
            "models": models,
            "health": {"interval": 1.0, "timeout": 2.0},
            "server": {"host": "127.0.0.1", "port": self.port, "log_level": "warning"},
        }
        if balancer:
            config["balancer"] = balancer
        path = workdir / f"gateway-{mode}-{self.port}.yaml"
        path.write_text(yaml.safe_dump(config))
        super().__init__([sys.executable, "-m", "gateway", "serve", "--config", str(path)], f"gateway ({mode})")
        self._wait(lambda: httpx.get(self.url + "/ready", timeout=2).json().get("healthy_backends") == gpus, 60)


@dataclass
class Trace:
    at: list[float] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    max_tokens: int = 48
    keys: list[str] = field(default_factory=list)  # per request, the key's name (mixed runs); empty: none
    outs: list[int] = field(default_factory=list)  # per request, its max_tokens (mixed runs); empty: max_tokens


WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "lambda"]


def _prompt(rng: random.Random, tag: str, tokens: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(tokens * CHARS_PER_TOKEN // 6 + 1))
    return f"request {tag}: " + body  # distinct from the first block: no prefix reuse


def make_trace(seed: int, rate: float, duration: float, prompt_tokens: tuple[int, int]) -> Trace:
    rng = random.Random(seed)
    t, trace = 0.0, Trace()
    while t < duration:
        t += rng.expovariate(rate)
        trace.at.append(t)
        trace.prompts.append(_prompt(rng, f"{len(trace.at) - 1} seed {seed}", rng.randint(*prompt_tokens)))
    return trace


def mixed_trace(seed: int, duration: float, ui_rate: float, ui_tokens: tuple[int, int], bulk_rate: float, bulk_tokens: tuple[int, int]) -> Trace:
    """Key ui: Poisson arrivals of short prompts, 16 output tokens. Key bulk (when ``bulk_rate``): long
    prompts, 48 output tokens, in bursts of 20 at ``bulk_rate`` on average (as ``trace.mixed_trace``)."""
    rng = random.Random(seed)
    items: list[tuple[float, str, str, int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(ui_rate)
        if t >= duration:
            break
        items.append((t, "ui", _prompt(rng, f"ui {len(items)} seed {seed}", rng.randint(*ui_tokens)), 16))
    if bulk_rate > 0:
        brng = random.Random(seed + 1000)  # the ui requests are the same with and without the flood
        t, burst_at, j = 0.0, 0.0, 0
        while True:
            t += brng.expovariate(bulk_rate)
            if t >= duration:
                break
            if j % 20 == 0:
                burst_at = t + brng.uniform(0, 1)
            items.append((min(duration, burst_at + 0.01 * (j % 20)), "bulk", _prompt(brng, f"bulk {j} seed {seed}", brng.randint(*bulk_tokens)), 48))
            j += 1
    items.sort(key=lambda x: x[0])
    return Trace(at=[x[0] for x in items], prompts=[x[2] for x in items], keys=[x[1] for x in items], outs=[x[3] for x in items])


@dataclass
class Sample:
    ok: bool
    ttft: float | None
    gaps: list[float]
    key: str = ""
    status: int = 0


async def one(session: aiohttp.ClientSession, url: str, at: float, prompt: str, max_tokens: int, start: float, key: str = "") -> Sample:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start + at - loop.time()))
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {KEYS[key][0]}"
    t0 = loop.time()
    last = None
    ttft = None
    gaps: list[float] = []
    ok = False
    status = 0
    try:
        async with session.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
            status = r.status
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
    return Sample(ok, ttft, gaps, key, status)


async def run_trace(url: str, trace: Trace) -> list[Sample]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = asyncio.get_running_loop().time() + 0.2
        keys = trace.keys or [""] * len(trace.at)
        outs = trace.outs or [trace.max_tokens] * len(trace.at)
        return await asyncio.gather(*(one(session, url, at, p, n, start, k) for at, p, n, k in zip(trace.at, trace.prompts, outs, keys)))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _mixed_run(gpus: int, max_batch_size: int, balancer: dict | None, trace: Trace, tmp: Path, dump: Path | None = None) -> dict:
    """One trace through a fresh PD gateway: the interactive TTFTs after warm-up, and the batch key's counts.
    dump: a JSON file for every request's arrival, key and TTFT (which ones are slow, run after run)."""
    gw = GatewayWithSims(tmp, "pd", gpus, max_batch_size, keys=KEYS, balancer=balancer)
    try:
        samples = asyncio.run(run_trace(gw.url, trace))
    finally:
        gw.stop()
    if dump is not None:
        dump.parent.mkdir(parents=True, exist_ok=True)
        dump.write_bytes(orjson.dumps([{"at": at, "key": s.key, "ttft": s.ttft, "status": s.status} for at, s in zip(trace.at, samples)]))
    ui = [s for s in samples if s.key == "ui"]
    ui = ui[len(ui) // 10:]  # warm-up
    bulk = [s for s in samples if s.key == "bulk"]
    ttfts = [s.ttft for s in ui if s.ttft is not None]
    return {
        "ui_n": len(ui), "ui_p50": pct(ttfts, 0.5), "ui_p99": pct(ttfts, 0.99),
        "ui_shed": sum(1 for s in ui if s.status in (429, 503)), "ui_err": sum(1 for s in ui if not s.ok and s.status not in (429, 503)),
        "bulk_n": len(bulk), "bulk_done": sum(1 for s in bulk if s.ok), "bulk_shed": sum(1 for s in bulk if s.status in (429, 503)),
        "bulk_p50": pct([s.ttft for s in bulk if s.ttft is not None], 0.5), "ttfts": ttfts,
    }


def _spread(values: list[float]) -> str:
    """mean [min-max] of a figure over repeated runs: one run is no verdict (same trace, busy CPUs)."""
    if not values:
        return "-"
    return f"{statistics.fmean(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def run_mixed(args: argparse.Namespace, duration: float) -> int:
    """Interactive TTFT in PD mode, alone and beside a batch flood from another key, ``--repeat``
    times per seed of ``--seeds``: every run a fresh gateway on the same seeded trace (the ui requests
    of a seed are the same alone and beside the flood). Reported per run, then per phase the mean and
    range of p99 over the runs, and p99 of all the runs' interactive TTFTs pooled (every seed and
    repeat: about 170 requests a run at 40 %, so one run's p99 is its second slowest request)."""
    prefills = args.gpus // 2
    capacity = prefills * SIM["prefill_tokens_per_s"]  # prompt tokens per second the prefill instances take
    ui_rate = args.ui_load * capacity / (sum(args.ui_prompt_tokens) / 2)
    bulk_rate = args.bulk_load * capacity / (sum(args.prompt_tokens) / 2)
    seeds = args.seeds or [args.seed]
    balancer = balancer_config(args.knobs, {}) if args.knobs else None
    print(f"PD mixed priority: seeds {seeds} x {args.repeat}, phases {args.phases}, {prefills}P+{args.gpus - prefills}D, {duration:g} s; ui (interactive) {ui_rate:.2f} req/s "
          f"({args.ui_load:.0%} of prefill capacity, prompts {args.ui_prompt_tokens[0]}-{args.ui_prompt_tokens[1]} tokens, 16 out), "
          f"bulk (batch) {bulk_rate:.2f} req/s ({args.bulk_load:.0%}, prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]}, 48 out, bursts of 20); "
          f"{args.max_batch_size} slots per instance; balancer {balancer or 'defaults'}")
    print(f"sim: {SIM}")
    runs: list[tuple[int, int, str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        for seed in seeds:
            traces = {
                "alone": mixed_trace(seed, duration, ui_rate, tuple(args.ui_prompt_tokens), 0.0, tuple(args.prompt_tokens)),
                "flood": mixed_trace(seed, duration, ui_rate, tuple(args.ui_prompt_tokens), bulk_rate, tuple(args.prompt_tokens)),
            }
            for i in range(args.repeat):
                for name in args.phases:
                    dump = args.dump / f"seed{seed}-run{i + 1}-{name}.json" if args.dump else None
                    r = _mixed_run(args.gpus, args.max_batch_size, balancer, traces[name], Path(tmp), dump)
                    runs.append((seed, i, name, r))
                    print(f"  seed {seed} run {i + 1} {name}: " + str({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "ttfts"}), flush=True)
    print(f"\n{'seed':>5}{'run':>4}{'phase':>7}{'ui n':>6}{'ui p50':>8}{'ui p99':>8}{'ui shed':>8}{'ui err':>7}{'bulk done':>10}{'bulk ttft p50':>14}   seconds")
    for seed, i, name, r in runs:
        bulk = f"{r['bulk_done']:>7d}/{r['bulk_n']:<3d}{r['bulk_p50']:>13.3f}" if r["bulk_n"] else f"{'-':>10}{'-':>14}"
        print(f"{seed:>5}{i + 1:>4}{name:>7}{r['ui_n']:>6}{r['ui_p50']:>8.3f}{r['ui_p99']:>8.3f}{r['ui_shed']:>8d}{r['ui_err']:>7d}{bulk}")
    pooled: dict[str, float] = {}
    print(f"\n{'phase':<7}{'runs':>5}{'ui p50 mean [range]':>24}{'ui p99 mean [range]':>24}{'p99 pooled':>12}{'n pooled':>10}{'bulk ttft p50 mean':>20}")
    for name in args.phases:
        rs = [r for _, _, n, r in runs if n == name]
        ttfts = [t for r in rs for t in r["ttfts"]]
        pooled[name] = pct(ttfts, 0.99)
        bulk = [r["bulk_p50"] for r in rs if r["bulk_n"]]
        print(f"{name:<7}{len(rs):>5}{_spread([r['ui_p50'] for r in rs]):>24}{_spread([r['ui_p99'] for r in rs]):>24}{pooled[name]:>12.3f}{len(ttfts):>10}"
              f"{(f'{statistics.fmean(bulk):.2f}' if bulk else '-'):>20}")
    if "alone" in pooled and "flood" in pooled:
        print(f"ui ttft p99 pooled, flood vs alone: {100 * (pooled['flood'] / pooled['alone'] - 1):+.0f}%")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing.pd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 s per mode instead of 60")
    ap.add_argument("--gpus", type=int, default=4, help="simulated GPUs per mode (PD splits them half prefill, half decode)")
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-batch-size", type=int, default=64, help="batch slots of every instance; small, the decode instances' slots bind before their KV")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(2000, 6000), metavar=("MIN", "MAX"))
    ap.add_argument("--mixed", action="store_true", help="PD only: interactive short requests (key ui) alone and beside a batch flood (key bulk) in bursts")
    ap.add_argument("--duration", type=float, default=None, help="trace seconds (default 60, --quick 20; --mixed 30)")
    ap.add_argument("--ui-load", type=float, default=0.4, help="--mixed: the interactive key's prompt tokens per second, a share of the prefill instances' capacity")
    ap.add_argument("--bulk-load", type=float, default=1.0, help="--mixed: the batch flood's, likewise")
    ap.add_argument("--ui-prompt-tokens", type=int, nargs=2, default=(500, 1500), metavar=("MIN", "MAX"), help="--mixed: the interactive prompts (the flood's: --prompt-tokens)")
    ap.add_argument("--repeat", type=int, default=1, help="--mixed: runs per seed and phase (a fresh gateway each), reported with mean, range and pooled p99")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="--mixed: several seeds, their runs pooled (default: --seed)")
    ap.add_argument("--phases", nargs="+", choices=("alone", "flood"), default=["alone", "flood"], help="--mixed: which runs (e.g. flood only to compare two settings)")
    ap.add_argument("--dump", type=Path, default=None, help="--mixed: write every request's arrival, key and TTFT per run to this folder")
    ap.add_argument("--knobs", default="", help="--mixed: balancer settings, field=value+queue.field=value (as bench.routing's --policies)")
    args = ap.parse_args(argv)
    duration = args.duration or (20.0 if args.quick else 30.0 if args.mixed else 60.0)
    if args.mixed:
        return run_mixed(args, duration)
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
