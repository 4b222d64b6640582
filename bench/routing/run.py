"""Routing bench: the same seeded open-loop trace through every balancer policy, side by side.

    python -m bench.routing            # both fleets at 60/80/95% load (about 25 min on 2 cores)
    python -m bench.routing --quick    # both fleets at 80% load, shorter trace (about 7 min)

For each fleet it starts simulated api_servers (``python -m gateway.sim``; homogeneous: four at
--speed 1; heterogeneous: 2.0/1.0/1.0/0.5) and keeps them for every run; each run starts one
gateway process with one policy, clears the backends' prefix caches, replays the trace and
prints throughput, end-to-end latency and time to first token. Half of the requests open with
one of 16 shared documents, so the prefix-cache hit rate is reported too (from the sims'
counters). Load is a fraction of the fleet's capacity at full batches with the documents cached.
Times and token counts are scaled (see ``trace.SimParams``); the first ``--warmup`` share of
requests is left out of the latency figures, and no run is timed by a test.

Columns: req/s and tok/s are completed requests and output tokens over the whole run (first send
to last answer, so a long tail lowers them); latency is send to last byte, TTFT send to the first
token's frame, both in seconds as the client sees them through the gateway; hit % is cached /
prompt tokens over the sims; share is the requests each backend got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/routing/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "bench.routing"

from .client import replay, summarize  # noqa: E402
from .fleet import GatewayProc, SimProc, SmgProc  # noqa: E402
from .trace import SimParams, fleet_capacity, make_trace, mixed_trace  # noqa: E402

MODEL = "bench-model"
FLEETS = {"heterogeneous": [2.0, 1.0, 1.0, 0.5], "homogeneous": [1.0, 1.0, 1.0, 1.0]}
POLICIES = ("least_in_flight", "min_expected_latency", "least_load", "round_robin", "random", "smg:cache_aware", "smg:least_load")
BASELINE = "least_in_flight"
# The mixed-priority run's keys: name -> (secret, priority class).
KEYS = {"ui": ("sk-bench-ui", "interactive"), "bulk": ("sk-bench-bulk", "batch")}


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v, v)


def start_router(workdir: Path, spec: str, sims: list[SimProc], balancer: dict, keys: dict | None = None):
    """``smg:POLICY`` (the SGLang model gateway), or ``POLICY[:field=value+queue.field=value...]`` (ours)."""
    name, _, knobs = spec.partition(":")
    if name == "smg":
        if keys:
            raise ValueError("the mixed-priority run needs per-key priorities, which smg launch has no flag for")
        return SmgProc(workdir, knobs, sims, MODEL)
    return GatewayProc(workdir, name, sims, balancer_config(knobs, balancer), keys)


def balancer_config(knobs: str, balancer: dict) -> dict:
    """The ``balancer:`` section for ``field=value+queue.field=value...`` on top of ``balancer``."""
    cfg = {**balancer, "queue": dict(balancer.get("queue", {}))}
    for kv in filter(None, knobs.split("+")):
        k, _, v = kv.partition("=")
        if k.startswith("queue."):
            cfg["queue"][k[6:]] = _value(v)
        else:
            cfg[k] = _value(v)
    if not cfg["queue"]:
        del cfg["queue"]
    return cfg


def fleet_row(sims, before: list[dict], results, wall: float, warmup: float, policy: str) -> dict:
    """One table row: the replay's latencies plus what the sims saw (prefix-cache hits, share per backend)."""
    _wait_idle(sims)
    after = [s.stats() for s in sims]
    row = summarize(results, wall, warmup=int(len(results) * warmup))
    every = summarize(results, wall, warmup=0)
    row["all_lat_mean"], row["all_ttft_mean"] = every["lat_mean"], every["ttft_mean"]
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    cached = sum(a["cached_tokens"] - b["cached_tokens"] for a, b in zip(after, before))
    row["hit_rate"] = cached / prompt if prompt else 0.0
    submitted = [a["submitted"] - b["submitted"] for a, b in zip(after, before)]
    total = sum(submitted) or 1
    row["share"] = "/".join(f"{100 * x / total:.0f}" for x in submitted)
    row["policy"] = policy
    # Per backend: the engine's real step seconds over its modelled ones, and the mean queue wait
    # for a slot (what --verbose prints beside the replay's figures).
    row["engines"] = [{k: a[k] - b[k] for k in ("step_model_s", "step_real_s", "queue_wait_s", "admitted", "steps", "completed", "latency_s", "first_token_s")} for a, b in zip(after, before)]
    return row


def _wait_idle(sims: list[SimProc], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.stats()["in_flight"] == 0 for s in sims):
            return
        time.sleep(0.2)
    raise TimeoutError("backends still busy after the previous run")


def dump_requests(path: Path, policy: str, sims: list[SimProc], trace, results) -> None:
    """Per request of the trace: the backend that served it (from the sims' request logs, matched
    by the messages), latency, TTFT and cached tokens as the client saw them; to set beside the
    replay's ``--dump`` of the same trace."""
    where: dict[str, int] = {}
    for b, s in enumerate(sims):
        for e in s.http.get("/_sim/requests", timeout=30).json():
            if e["path"].endswith("/chat/completions") and e["body"]:
                where[_key(e["body"])] = b
    rows = [{"i": r.index, "backend": where.get(_key(trace.items[r.index].body), -1), "latency": r.latency, "ttft": r.ttft,
             "cached": r.cached_tokens, "prompt": r.prompt_tokens, "out": r.completion_tokens} for r in results]
    path.mkdir(parents=True, exist_ok=True)
    (path / f"socket-{policy.replace(':', '_')}.json").write_text(json.dumps(rows))


def _key(body: dict) -> str:
    messages = body.get("messages") or [{}]
    return str(messages[-1].get("content"))  # the question: random words, one per request


def run_one(workdir: Path, policy: str, sims: list[SimProc], trace, warmup: float, balancer: dict, verbose: bool = False,
            keys: dict | None = None, dump: Path | None = None) -> dict:
    _wait_idle(sims)
    for s in sims:
        s.control(clear_cache=True)
        s.http.delete("/_sim/requests")
    before = [s.stats() for s in sims]
    gw = start_router(workdir, policy, sims, balancer, keys)
    secrets = {n: k for n, (k, _) in (keys or {}).items()}
    try:
        results, wall = asyncio.run(replay(gw.url, trace, timeout=trace.duration * 4 + 60, secrets=secrets))
    finally:
        gw.stop()
    if gw.state_path.exists():
        print(f"  [{policy}] balancer state: {gw.state_path.read_text()}" if verbose else "", end="")
    row = fleet_row(sims, before, results, wall, warmup, policy)
    if dump is not None:
        dump_requests(dump, policy, sims, trace, results)
    if keys:
        for name in keys:
            mine = [r for r in results if r.key == name]
            sub = summarize(mine, wall, warmup=int(len(mine) * warmup))
            row[f"{name}_ttft_p99"] = sub["ttft_p99"]
            row[f"{name}_lat_p99"] = sub["lat_p99"]
            row[f"{name}_refused"] = sub["refused"]
            # Finished by the trace's end: the key's throughput (a flood beyond capacity finishes later).
            row[f"{name}_done"] = sum(1 for r in mine if r.ok and trace.items[r.index].at + r.latency <= trace.duration)
    return row


COLUMNS = (
    ("policy", "policy", "{:<36}"),
    ("throughput_rps", "req/s", "{:>6.2f}"),
    ("tokens_per_s", "tok/s", "{:>6.0f}"),
    ("lat_mean", "lat mean", "{:>8.2f}"),
    ("lat_p50", "lat p50", "{:>8.2f}"),
    ("lat_p99", "lat p99", "{:>8.2f}"),
    ("ttft_mean", "ttft mean", "{:>9.3f}"),
    ("ttft_p50", "ttft p50", "{:>9.3f}"),
    ("ttft_p99", "ttft p99", "{:>9.3f}"),
    ("hit_rate", "hit %", "{:>6.1%}"),
    ("errors", "err", "{:>4d}"),
    ("refused", "shed", "{:>5d}"),
    ("refusal_p99", "shed p99", "{:>8.3f}"),
    ("share", "share % per backend", "  {}"),
)


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(" ".join(f"{h:>{len(fmt.format(0) if 'd' in fmt or 'f' in fmt or '%' in fmt else h)}}" if k != "policy" and k != "share" else (f"{h:<36}" if k == "policy" else f"  {h}") for k, h, fmt in COLUMNS))
    base = next((r for r in rows if r["policy"] == BASELINE), None)
    for r in rows:
        line = " ".join(fmt.format(r[k]) for k, _, fmt in COLUMNS)
        if base is not None and r is not base and base["lat_p99"] > 0:
            line += f"   p99 {100 * (r['lat_p99'] / base['lat_p99'] - 1):+.0f}% vs {BASELINE}"
        if r.get("refused"):
            line += f"   {r['refusals_with_retry_after']}/{r['refused']} refusals with Retry-After"
        print(line, flush=True)


def run_mixed(workdir: Path, sims, speeds, fleet: str, capacity: float, loads, policies, duration: float, args, balancer: dict) -> list[dict]:
    """Interactive TTFT with and without a batch flood from another key, for each of our policies."""
    rows = []
    for load in loads:
        alone = mixed_trace(args.seed, interactive_rate=load * capacity, batch_rate=0.0, duration=duration, model=MODEL)
        flood = mixed_trace(args.seed, interactive_rate=load * capacity, batch_rate=capacity, duration=duration, model=MODEL)
        print(f"\nmixed priority, {fleet} fleet: interactive (key ui, short outputs) at {load:.0%} of capacity, "
              f"alone ({len(alone.items)} requests) and with a batch flood at 100% (key bulk, {len(flood.items) - len(alone.items)} requests in bursts of 20)")
        print(f"{'policy':<36} {'ui ttft p99 alone':>18} {'ui ttft p99 flood':>18} {'change':>7} {'ui lat p99 alone':>17} {'ui lat p99 flood':>17} "
              f"{'ui shed':>8} {'bulk shed':>9} {'bulk lat p99':>12} {'bulk done':>9}")
        for policy in policies:
            if policy.startswith("smg:"):
                continue
            dump = args.dump
            a = run_one(workdir, policy, sims, alone, args.warmup, balancer, args.verbose, keys=KEYS, dump=dump and dump / "alone")
            f = run_one(workdir, policy, sims, flood, args.warmup, balancer, args.verbose, keys=KEYS, dump=dump and dump / "flood")
            change = 100 * (f["ui_ttft_p99"] / a["ui_ttft_p99"] - 1) if a["ui_ttft_p99"] > 0 else float("nan")
            print(f"{policy:<36} {a['ui_ttft_p99']:>18.3f} {f['ui_ttft_p99']:>18.3f} {change:>+6.0f}% {a['ui_lat_p99']:>17.2f} {f['ui_lat_p99']:>17.2f} "
                  f"{f['ui_refused']:>8d} {f['bulk_refused']:>9d} {f['bulk_lat_p99']:>12.2f} {f['bulk_done']:>9d}", flush=True)
            rows.append({"mode": "mixed", "fleet": fleet, "load": load, "policy": policy, "alone": a, "flood": f})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="80%% load only, 40 s traces")
    p.add_argument("--fleets", default="heterogeneous,homogeneous", help="comma list of: " + ", ".join(FLEETS))
    p.add_argument("--loads", default=None, help="comma list of fractions of fleet capacity (default 0.6,0.8,0.95; --quick 0.8)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--duration", type=float, default=None, help="trace seconds (default 60; --quick 40)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--shared", type=float, default=0.5, help="share of requests that open with a shared document")
    p.add_argument("--warmup", type=float, default=0.1, help="share of the first requests left out of the figures")
    p.add_argument("--verbose", action="store_true", help="print each balancer's learnt state after its run")
    p.add_argument("--json", type=Path, default=None, help="also write every row here")
    p.add_argument("--dump", type=Path, default=None, help="write each run's per-request backend, latency, TTFT, cached tokens into this folder")
    p.add_argument("--mixed", action="store_true",
                   help="mixed-priority run instead: interactive short requests (key ui) at --loads, alone and with a batch flood (key bulk) at 100%% load")
    args = p.parse_args(argv)
    loads = [float(x) for x in (args.loads or ("0.8" if args.quick else "0.6,0.8,0.95")).split(",")]
    duration = args.duration or (40.0 if args.quick else 60.0)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    fleets = [x.strip() for x in args.fleets.split(",") if x.strip()]
    for f in fleets:
        if f not in FLEETS:
            p.error(f"unknown fleet {f!r}; choose from {', '.join(FLEETS)}")
    params = SimParams()
    balancer = {"scrape_interval": 2.0}
    all_rows = []
    print(f"routing bench: seed {args.seed}, {duration:g} s traces, {args.shared:.0%} shared-prefix requests, policies {', '.join(policies)}")
    print(f"sim: tpot {params.tpot}s ttft {params.ttft}s prefill {params.prefill_tokens_per_s:g} tok/s, batch {params.max_batch_size}, "
          f"slowdown {params.batch_slowdown}/seq, gauges every {params.metrics_interval:g}s (times 10x LMDeploy's, outputs ~10x shorter)")
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        workdir = Path(tmp)
        for fleet in fleets:
            speeds = FLEETS[fleet]
            sims: list[SimProc] = []
            try:
                for sp in speeds:
                    sims.append(SimProc(MODEL, sp, params.argv(sp, record_limit=20_000 if args.dump else 0)))
                capacity = fleet_capacity(params, speeds, args.seed, MODEL, args.shared)
                if args.mixed:
                    all_rows += run_mixed(workdir, sims, speeds, fleet, capacity, loads, policies, duration, args, balancer)
                    continue
                for load in loads:
                    trace = make_trace(args.seed, rate=load * capacity, duration=duration, model=MODEL, shared_share=args.shared)
                    rows = []
                    for policy in policies:
                        row = run_one(workdir, policy, sims, trace, args.warmup, balancer, args.verbose, dump=args.dump)
                        row.update(fleet=fleet, load=load)
                        if args.verbose:
                            print(f"  [{policy}] per backend: real/model step s, steps, mean queue wait s: " + "  ".join(
                                f"{e['step_real_s']:.1f}/{e['step_model_s']:.1f} ({e['steps']}) {e['queue_wait_s'] / max(1, e['admitted']):.3f}" for e in row["engines"]), flush=True)
                            done = sum(e["completed"] for e in row["engines"]) or 1
                            sim_lat, sim_ttft = sum(e["latency_s"] for e in row["engines"]) / done, sum(e["first_token_s"] for e in row["engines"]) / done
                            print(f"  [{policy}] every request, mean: latency {row['all_lat_mean']:.3f} s at the client, {sim_lat:.3f} in the sims "
                                  f"(relay {row['all_lat_mean'] - sim_lat:+.3f}); first token {row['all_ttft_mean']:.3f} / {sim_ttft:.3f} ({row['all_ttft_mean'] - sim_ttft:+.3f})", flush=True)
                        rows.append(row)
                        all_rows.append(row)
                    title = (f"{fleet} fleet (speeds {'/'.join(f'{s:g}' for s in speeds)}), {load:.0%} load: "
                             f"{trace.rate:.1f} req/s, {len(trace.items)} requests, mean prompt {trace.mean_prompt:.0f} / output {trace.mean_output:.0f} tokens; seconds")
                    print_table(title, rows)
            finally:
                for s in sims:
                    s.stop()
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
