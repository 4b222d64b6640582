"""Replicas scenario: N gateway replicas sharing one fleet through one Redis, against one replica.

    python -m bench.routing.replicas --quick   # heterogeneous fleet, 80% load, 30 s trace: about 4 min
    python -m bench.routing.replicas           # 60 s trace
    python -m bench.routing.replicas --quick --repeat 5   # 5 rounds, rows interleaved: median ratios and spread

One run, one seeded trace (the routing bench's workload, ``trace.py``), the heterogeneous fleet
(speeds 2/1/1/0.5) kept for every row:

- ``1 replica``: one gateway, in-memory state (what a single process does today; the baseline);
- ``1 replica + redis``: the same with ``state: {redis_url: ...}`` (the cost of the store alone);
- ``N replicas + redis``: N gateway processes with the same config and one Redis; request i goes
  to replica ``i % N`` (a round-robin load balancer in front of them). Each replica's balancer
  sees its own requests in full and, for the others', their in-flight count per backend and what
  those requests hold there (KV, output left, prefill), published through Redis
  (``Backend.remote_in_flight``, ``remote_kv``...), and the prefixes they placed on each backend
  with their prompts' sizes, and each completion's speed and mean batch, which every replica learns
  σ and γ from as from its own (``gateway/state/cluster.py``).
  ``python -m bench.routing.offline --replicas N`` is the same scenario in virtual time.

The bench starts its own redis-server on a free loopback port and stops it at the end.
Figures: as in ``run.py`` (seconds; the first ``--warmup`` share of requests left out).

One run's TTFT p99 is its ~7th worst request of ~675 (``--quick``): on a shared 2-core machine it
moves by tens of percent between runs of the same code. ``--repeat N`` runs the rows N times,
interleaved (1, 1+redis, N+redis, 1, 1+redis, ...), on the same trace, so slow spells of the machine
fall on every row alike; it prints each round's ratios against that round's one replica, then per row
the median ratio and its range, the ratio of the pooled figures (every round's requests together: a
p99 of N×675), and the noise floor: the one-replica row against itself across rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: python bench/routing/replicas.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "bench.routing"

from .client import pct, replay  # noqa: E402
from .fleet import GatewayProc, RedisProc, SimProc  # noqa: E402
from .run import COLUMNS, FLEETS, MODEL, _wait_idle, balancer_config, fleet_row  # noqa: E402
from .trace import SimParams, fleet_capacity, make_trace  # noqa: E402

POLICY = "min_expected_latency:slots=32"


def run_replicas(workdir: Path, name: str, spec: str, n: int, sims: list[SimProc], trace, warmup: float, balancer: dict,
                 state: dict | None, learnt: bool = False) -> dict:
    _wait_idle(sims)
    for s in sims:
        s.control(clear_cache=True)
    before = [s.stats() for s in sims]
    policy, _, knobs = spec.partition(":")
    cfg = balancer_config(knobs, balancer)
    gateways: list[GatewayProc] = []
    try:
        for _ in range(n):
            gateways.append(GatewayProc(workdir, policy, sims, cfg, state=state))
        results, wall = asyncio.run(replay([g.url for g in gateways], trace, timeout=trace.duration * 4 + 60))
        errors = state_errors(gateways) if state else {}
    finally:
        for g in gateways:
            g.stop()
    if learnt:
        for i, g in enumerate(gateways):
            try:
                st = json.loads(g.state_path.read_text())
            except (OSError, ValueError):
                continue
            print(f"  {name} #{i}: picks {st.get('picks')} affinity {st.get('affinity_picks')} gamma {st.get('gamma', 0):.4f} rho {st.get('rho', 0):.4f}"
                  f"  sigma {' '.join(f'{v:.4f}' for v in st.get('sigma', {}).values())}"
                  f"  kv capacity {' '.join(f'{v:.0f}' if v else '-' for v in st.get('kv_capacity', {}).values())}", flush=True)
    if errors:
        # A Redis call past state.timeout (a loaded machine) drops that exchange's load and placements.
        print(f"  {name}: Redis calls failed or timed out: " + ", ".join(f"{op} {n}" for op, n in sorted(errors.items())), flush=True)
    row = fleet_row(sims, before, results, wall, warmup, name)
    # Kept for --repeat's pooled figures: the same requests summarize() reads.
    row["ttfts"] = [r.ttft for r in results[int(len(results) * warmup):] if r.ok and r.ttft is not None]
    return row


def state_errors(gateways: list[GatewayProc]) -> dict[str, int]:
    """gateway_state_errors_total summed over the gateways, by operation (from their /metrics)."""
    out: dict[str, int] = {}
    for g in gateways:
        try:
            text = httpx.get(g.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for op, n in parse_state_errors(text).items():
            out[op] = out.get(op, 0) + n
    return {op: n for op, n in out.items() if n}


def parse_state_errors(text: str) -> dict[str, int]:
    """gateway_state_errors_total by operation, from one /metrics page."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("gateway_state_errors_total{"):
            op = line.split('op="', 1)[1].split('"', 1)[0]
            out[op] = out.get(op, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'gateways':<36} " + " ".join(f"{h:>{len(fmt.format(0))}}" for k, h, fmt in COLUMNS[1:-1]) + "   share % per backend")
    base = rows[0]
    for r in rows:
        line = " ".join(fmt.format(r[k]) for k, _, fmt in COLUMNS)
        if r is not base:
            line += (f"   ttft p99 {100 * (r['ttft_p99'] / base['ttft_p99'] - 1):+.0f}%, mean {100 * (r['ttft_mean'] / base['ttft_mean'] - 1):+.0f}%"
                     f" vs {base['policy']}")
        print(line, flush=True)


def _ratio(a: float, b: float) -> float:
    return a / b - 1 if b > 0 else float("nan")


def repeat_summary(rounds: list[list[dict]]) -> dict:
    """Per row name, over the rounds: each round's TTFT p99 and mean ratios against that round's
    first row (the one replica), their median and range, and the ratios of the pooled figures
    (every round's TTFTs together); plus the first row against itself (the noise floor): each
    round's p99 and mean against the median of all rounds'. Ratios are fractions (0.1 = +10 %)."""
    base_name = rounds[0][0]["policy"]
    out: dict = {"base": base_name, "rows": {}}
    pooled = {}
    for rows in rounds:
        for r in rows:
            pooled.setdefault(r["policy"], []).extend(r["ttfts"])
    for name in (r["policy"] for r in rounds[0][1:]):
        p99 = [_ratio(next(r for r in rows if r["policy"] == name)["ttft_p99"], rows[0]["ttft_p99"]) for rows in rounds]
        mean = [_ratio(next(r for r in rows if r["policy"] == name)["ttft_mean"], rows[0]["ttft_mean"]) for rows in rounds]
        out["rows"][name] = {
            "p99": p99, "mean": mean,
            "p99_median": statistics.median(p99), "mean_median": statistics.median(mean),
            "pooled_p99": _ratio(pct(pooled[name], 99), pct(pooled[base_name], 99)),
            "pooled_mean": _ratio(statistics.fmean(pooled[name]), statistics.fmean(pooled[base_name])),
        }
    base_p99 = [rows[0]["ttft_p99"] for rows in rounds]
    base_mean = [rows[0]["ttft_mean"] for rows in rounds]
    out["floor"] = {"p99": base_p99, "mean": base_mean,
                    "p99_vs_median": [_ratio(v, statistics.median(base_p99)) for v in base_p99],
                    "mean_vs_median": [_ratio(v, statistics.median(base_mean)) for v in base_mean]}
    return out


def print_repeat(s: dict, n_rounds: int) -> None:
    pcts = lambda xs: " ".join(f"{100 * x:+4.0f}%" for x in xs)  # noqa: E731
    rng = lambda xs: f"{100 * min(xs):+.0f}..{100 * max(xs):+.0f}%"  # noqa: E731
    f = s["floor"]
    print(f"\n{n_rounds} rounds, interleaved; TTFT against the same round's {s['base']} (pooled: all rounds' requests together):")
    print(f"{'row':<24} {'p99 per round':<{6 * n_rounds}} {'median':>7} {'range':>12}  {'mean per round':<{6 * n_rounds}} {'median':>7} {'range':>12}  pooled p99 / mean")
    for name, r in s["rows"].items():
        print(f"{name:<24} {pcts(r['p99']):<{6 * n_rounds}} {100 * r['p99_median']:+6.0f}% {rng(r['p99']):>12}  "
              f"{pcts(r['mean']):<{6 * n_rounds}} {100 * r['mean_median']:+6.0f}% {rng(r['mean']):>12}  {100 * r['pooled_p99']:+.0f}% / {100 * r['pooled_mean']:+.0f}%")
    print(f"noise floor, {s['base']} against itself (each round against the median of the {n_rounds}):")
    print(f"  ttft p99  {' '.join(f'{v:.3f}' for v in f['p99'])}  -> {pcts(f['p99_vs_median'])}  (range {rng(f['p99_vs_median'])})")
    print(f"  ttft mean {' '.join(f'{v:.3f}' for v in f['mean'])}  -> {pcts(f['mean_vs_median'])}  (range {rng(f['mean_vs_median'])})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing.replicas", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="30 s trace")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--load", type=float, default=0.8, help="fraction of the fleet's capacity")
    p.add_argument("--policy", default=POLICY, help="balancer policy with knobs, as in bench.routing --policies")
    p.add_argument("--duration", type=float, default=None, help="trace seconds (default 60; --quick 30)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--shared", type=float, default=0.5, help="share of requests that open with a shared document")
    p.add_argument("--warmup", type=float, default=0.1, help="share of the first requests left out of the figures")
    p.add_argument("--load-interval", type=float, default=None, help="state.load_interval of the replicas (default: the gateway's, 0.02 s)")
    p.add_argument("--no-single-redis", action="store_true", help="leave out the one-replica-with-Redis row")
    p.add_argument("--repeat", type=int, default=1, help="rounds of all rows, interleaved on the same trace; prints median ratios, their range and the noise floor")
    p.add_argument("--learnt", action="store_true", help="print what each gateway learnt (picks, σ, γ, ρ, KV capacity per backend)")
    args = p.parse_args(argv)
    if not 1 <= args.replicas <= 16:
        p.error("--replicas must be 1-16")
    if not 1 <= args.repeat <= 50:
        p.error("--repeat must be 1-50")
    duration = args.duration or (30.0 if args.quick else 60.0)
    speeds = FLEETS["heterogeneous"]
    params = SimParams()
    balancer = {"scrape_interval": 2.0}
    print(f"replicas bench: seed {args.seed}, {duration:g} s trace, policy {args.policy}, {args.replicas} replicas round-robin through one Redis")
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        workdir = Path(tmp)
        sims: list[SimProc] = []
        redis = None
        try:
            redis = RedisProc(workdir)
            for sp in speeds:
                sims.append(SimProc(MODEL, sp, params.argv(sp)))
            capacity = fleet_capacity(params, speeds, args.seed, MODEL, args.shared)
            trace = make_trace(args.seed, rate=args.load * capacity, duration=duration, model=MODEL, shared_share=args.shared)
            runs = [("1 replica", 1, None)]
            if not args.no_single_redis:
                runs.append(("1 replica + redis", 1, "single"))
            runs.append((f"{args.replicas} replicas + redis", args.replicas, "shared"))
            title = (f"heterogeneous fleet (speeds {'/'.join(f'{s:g}' for s in speeds)}), {args.load:.0%} load: {trace.rate:.1f} req/s, "
                     f"{len(trace.items)} requests, mean prompt {trace.mean_prompt:.0f} / output {trace.mean_output:.0f} tokens; seconds")
            rounds = []
            for k in range(args.repeat):
                rows = []
                for i, (name, n, prefix) in enumerate(runs):
                    # A fresh key prefix per row and round: no load or replica entry of an earlier row is seen.
                    state = {"redis_url": redis.url, "prefix": f"bench{k}-{i}"} if prefix else None
                    if state and args.load_interval is not None:
                        state["load_interval"] = args.load_interval
                    rows.append(run_replicas(workdir, name, args.policy, n, sims, trace, args.warmup, balancer, state, args.learnt))
                rounds.append(rows)
                print_rows(title if args.repeat == 1 else f"round {k + 1}/{args.repeat}: {title}", rows)
            if args.repeat > 1:
                print_repeat(repeat_summary(rounds), args.repeat)
        finally:
            for s in sims:
                s.stop()
            if redis is not None:
                redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
