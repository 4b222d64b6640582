"""The latency the gateway adds to a stream's first token and to its end, side by side in one run.

One simulated api_server (``python -m gateway.sim``, fixed timing), reached three ways:
  direct           the simulator itself
  gateway          ``gateway serve`` with the default config (our HTTP/1.1 server, our upstream client,
                   min_expected_latency with the gateway queue on)
  gateway@TREE     ``gateway serve`` from another checkout (e.g. ``git archive main | tar -x -C TREE``):
                   before and after a change, in one run

Each client is a keep-alive HTTP/1.1 connection on a raw asyncio socket (no client library between
the bytes and the clock). TTFT: request written -> the first ``data:`` frame read; end: -> the
chunked terminator read. Targets take turns in short rounds so that drift on the shared machine
hits them alike; the "added" columns are the gateway's figure minus direct's at the same quantile.

    python bench/ttft_added.py [--concurrency 1,16] [--requests 240] [--rounds 4] [--targets direct,gateway,gateway@/tmp/base]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.overhead import MODEL, free_port, gateway_config, process, wait_http  # noqa: E402


async def _client(port: int, head: bytes, body: bytes, n: int, out: list[tuple[float, float]]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            writer.write(head + body)
            buf = b""
            while b"\r\n\r\n" not in buf:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("closed before the response head")
                buf += data
            status = buf[9:12]
            if status != b"200":
                raise RuntimeError(f"status {status!r}: {buf[:300]!r}")
            buf = buf.split(b"\r\n\r\n", 1)[1]
            ttft = None
            while True:
                if ttft is None and b"data:" in buf:
                    ttft = time.perf_counter() - t0
                if buf.endswith(b"0\r\n\r\n") and b"[DONE]" in buf:
                    break
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("closed mid-stream")
                buf = buf[-64:] + data if ttft is not None else buf + data
            out.append((ttft if ttft is not None else float("nan"), time.perf_counter() - t0))
    finally:
        writer.close()


async def _round(port: int, key: str | None, concurrency: int, requests: int, max_tokens: int, prompt: str) -> list[tuple[float, float]]:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                         "max_tokens": max_tokens, "stream": True})
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            + (f"authorization: Bearer {key}\r\n".encode() if key else b"")
            + b"content-length: %d\r\n\r\n" % len(body))
    out: list[tuple[float, float]] = []
    per = max(1, requests // concurrency)
    await asyncio.gather(*(_client(port, head, body, per, out) for _ in range(concurrency)))
    return out


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=240, help="requests per target and concurrency (split over the rounds)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ttft", type=float, default=0.02, help="the simulator's fixed latency before the engine")
    ap.add_argument("--tpot", type=float, default=0.005, help="the simulator's decode step")
    ap.add_argument("--targets", default="direct,gateway")
    ap.add_argument("--prompt-chars", type=int, default=0, help="a longer prompt (the routing bench's are 1-4k chars): per-request work that grows with it")
    args = ap.parse_args()
    from gateway.state.keys import hash_key, new_key

    key = new_key()
    prompt = "Say hello in one short sentence."
    if args.prompt_chars:
        prompt = ("lorem ipsum dolor sit amet " * (args.prompt_chars // 27 + 1))[: args.prompt_chars]
    tmp = Path(tempfile.mkdtemp(prefix="gw-ttft-"))
    sim_port = free_port()
    targets = args.targets.split(",")
    with contextlib.ExitStack() as stack:
        stack.enter_context(process([sys.executable, "-m", "gateway.sim", "--port", str(sim_port), "--model", MODEL,
                                     "--ttft", str(args.ttft), "--tpot", str(args.tpot), "--max-batch-size", "64",
                                     "--log-level", "warning"]))
        wait_http(f"http://127.0.0.1:{sim_port}/health")
        ports: dict[str, tuple[int, str | None]] = {}
        for t in targets:
            if t == "direct":
                ports[t] = (sim_port, None)
                continue
            tree = t.partition("@")[2]
            port = free_port()
            cfg = tmp / f"gateway-{port}.yaml"
            gateway_config(cfg, sim_port, hash_key(key))
            # Another checkout's package first on the path (ahead of this one's editable install).
            entry = ["-c", f"import sys, runpy; sys.path.insert(0, {tree!r}); runpy.run_module('gateway', run_name='__main__')"] if tree else ["-m", "gateway"]
            stack.enter_context(process([sys.executable, *entry, "serve", "--config", str(cfg), "--port", str(port)]))
            wait_http(f"http://127.0.0.1:{port}/ready")
            ports[t] = (port, key)
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for c in (int(x) for x in args.concurrency.split(",")):
            for t, (port, k) in ports.items():  # warm-up: connections, the balancer's first estimates
                asyncio.run(_round(port, k, c, 2 * c, args.max_tokens, prompt))
            for _ in range(args.rounds):
                for t, (port, k) in ports.items():
                    results.setdefault((t, c), []).extend(asyncio.run(_round(port, k, c, args.requests // args.rounds, args.max_tokens, prompt)))
    print(f"sim --ttft {args.ttft} --tpot {args.tpot}, max_tokens {args.max_tokens}, prompt {len(prompt)} chars; ms; added = target - direct at the same quantile")
    print(f"{'target':24} {'c':>3} {'n':>5} {'ttft p50':>9} {'p99':>7} {'e2e p50':>9} {'p99':>7} | {'added ttft p50':>14} {'p99':>7} {'mean':>7} | {'added e2e p50':>13} {'p99':>7} {'mean':>7}")
    for (t, c), rs in results.items():
        tt, ee = [r[0] * 1e3 for r in rs], [r[1] * 1e3 for r in rs]
        base = results.get(("direct", c))
        bt, be = ([r[0] * 1e3 for r in base], [r[1] * 1e3 for r in base]) if base else (tt, ee)
        print(f"{t:24} {c:>3} {len(rs):>5} {q(tt, .5):9.2f} {q(tt, .99):7.2f} {q(ee, .5):9.2f} {q(ee, .99):7.2f} | "
              f"{q(tt, .5) - q(bt, .5):14.2f} {q(tt, .99) - q(bt, .99):7.2f} {statistics.fmean(tt) - statistics.fmean(bt):7.2f} | "
              f"{q(ee, .5) - q(be, .5):13.2f} {q(ee, .99) - q(be, .99):7.2f} {statistics.fmean(ee) - statistics.fmean(be):7.2f}")


if __name__ == "__main__":
    main()
