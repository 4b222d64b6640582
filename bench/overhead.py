"""What the gateway adds on top of a backend, measured side by side in one run.

Targets, all against the same very fast fake backend (bench/fake_backend.py):
  direct            the backend itself: the limit
  gateway           auth, path/body/media policy, balancer, our HTTP/1.1 client, on our HTTP/1.1
                    server (gateway/server): the product has no other client or server
  lmdeploy-proxy    `lmdeploy serve proxy`, when lmdeploy is installed
  gateway+memory    the bench key with limits (rpm, tpm, concurrency): in-memory state store
  gateway+redis     the same limits in Redis (redis-server started by the bench): one round trip each
  gateway+redis-w2  `gateway serve --workers 2` with Redis (cpu/req sums both workers)
  gateway+redis-w2pin  the same with --pin-workers (each worker on its own CPU)
  gateway+redis-open, gateway+redis-open-w2
                    the same Redis store (keys, usage, shared load) with a key that has no limits:
                    what sharing costs without what the limits cost
  smg               the SGLang model gateway (Rust), when installed in .venv-smg (see below)

The state rows print Redis scripts per request (from INFO commandstats) and Redis's CPU per request
beside the gateway's. SMG: `python3 -m venv .venv-smg && .venv-smg/bin/pip install smg`.

Load comes from wrk (Debian package `wrk`), at concurrency 1 and 32, non-streaming and streaming.

The proxy baseline needs lmdeploy, which needs no GPU to proxy; without CUDA wheels it installs
like this (a separate, git-ignored venv; the imports pull torch):

    python3 -m venv .venv-lmdeploy
    .venv-lmdeploy/bin/pip install --no-deps lmdeploy
    .venv-lmdeploy/bin/pip install torch fastapi fire mmengine-lite numpy "pydantic>2" shortuuid \
        transformers uvicorn aiohttp requests prometheus_client pillow safetensors sentencepiece \
        tiktoken einops partial_json_parser openai pybase64 pyzmq cloudpickle protobuf psutil openai_harmony

    python bench/overhead.py [--duration 5] [--targets direct,gateway,gateway+memory] [--rounds 3]

Every target is started first and paused while the others are measured; with --rounds N each
(mode, concurrency) cell is measured N times, the targets taking turns, and the table gives medians,
followed by each target's req/s and cpu/req ratios to SMG and to the lmdeploy proxy (median and range
over the rounds): the comparison this shared 2-core machine allows, since its speed drifts by tens
of percent within minutes.

On a machine with more cores, --proxy-cpus 0,1 --load-cpus 2-15 gives each proxy under test (the
gateway with its workers, SMG, the lmdeploy proxy) exactly those cores and keeps the load generator,
the backend and redis-server off them: the proxies' own capacity, without the contention that the
2-core machine adds (SMG's and tokio's thread counts follow the affinity mask).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0, headers: dict[str, str] | None = None, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with status {proc.returncode} before {url} answered (BENCH_LOG_DIR=DIR keeps its output)")
        try:
            if httpx.get(url, headers=headers, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def cpu_list(text: str | None) -> set[int] | None:
    """``0,1`` or ``2-15`` (or both, comma-separated) as a set of CPU numbers; None when not given."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    unknown = cpus - os.sched_getaffinity(0)
    if unknown:
        sys.exit(f"CPUs {sorted(unknown)} are not available here (this process may use {sorted(os.sched_getaffinity(0))})")
    return cpus


def pinned(cpus: set[int] | None):
    """A preexec_fn that puts the child (and everything it starts) on ``cpus``; None leaves it unpinned."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


@contextlib.contextmanager
def process(argv: list[str], cpus: set[int] | None = None, **kw):
    # BENCH_LOG_DIR=DIR keeps each process's output (to read why a row has errors); else it is dropped
    logs = os.environ.get("BENCH_LOG_DIR")
    out = open(Path(logs) / f"{Path(argv[0]).name}-{'-'.join(a.rsplit('/', 1)[-1] for a in argv[1:4])}-{time.monotonic_ns()}.log", "wb") if logs else subprocess.DEVNULL
    proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True, stdout=out, stderr=subprocess.STDOUT if logs else subprocess.DEVNULL,
                            preexec_fn=pinned(cpus), **kw)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
            os.killpg(proc.pid, signal.SIGCONT)  # a paused target (see main) handles its SIGTERM only once resumed
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def wrk(url: str, concurrency: int, duration: float, body: bytes, key: str | None, cpus: set[int] | None = None) -> dict[str, float]:
    lua = ['wrk.method = "POST"', 'wrk.headers["Content-Type"] = "application/json"', f"wrk.body = [[{body.decode()}]]"]
    if key:
        lua.append(f'wrk.headers["Authorization"] = "Bearer {key}"')
    lua.append(
        "done = function(summary, latency, requests)\n"
        '  io.write(string.format("RESULT %d %d %d %f %f %f\\n", summary.requests, summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout, summary.duration, latency:percentile(50), latency:percentile(99), latency.mean))\n'
        "end"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write("\n".join(lua))
        script = f.name
    try:
        threads = 1 if concurrency == 1 else 2
        out = subprocess.run(
            ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{max(1, int(duration))}s", "--timeout", "10s", "-s", script, url],
            capture_output=True, text=True, timeout=duration + 60, preexec_fn=pinned(cpus),
        ).stdout
    finally:
        os.unlink(script)
    m = re.search(r"RESULT (\d+) (\d+) (\d+) ([\d.]+) ([\d.]+) ([\d.]+)", out)
    if not m:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    n, errors, dur_us, p50, p99, mean = m.groups()
    return {"rps": int(n) / (int(dur_us) / 1e6), "errors": int(errors), "p50_ms": float(p50) / 1000, "p99_ms": float(p99) / 1000}


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: a cost per request that other load on the machine does not distort."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its live descendants (the workers of --workers N)."""
    total = 0.0
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
    return total


def descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{name}/stat").read_bytes()
                parents[int(name)] = int(stat[stat.rfind(b")") + 2 :].split()[1])
    out: list[int] = []
    frontier = {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - set(out)
        out += sorted(frontier)
    return out


# The key limits the state rows carry: high enough never to refuse, present so each request is admitted.
STATE_LIMITS = {"rate_limit_rpm": 1_000_000_000, "rate_limit_tpm": 1_000_000_000_000, "max_concurrent": 100_000}


def redis_commands(port: int) -> int:
    """Scripts run by Redis so far (admission and settle scripts: EVALSHA/EVAL calls)."""
    import redis

    with redis.Redis(port=port) as r:
        stats = r.info("commandstats")
    return sum(v.get("calls", 0) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def gateway_config(path: Path, backend_port: int, key_hash: str, state: dict | None = None, limits: bool = True) -> None:
    key = {"name": "bench", "hash": key_hash}
    if state is not None and limits:
        key.update(STATE_LIMITS)
    cfg = {
        "server": {"log_level": "warning"},
        "auth": {"keys": [key]},
        "backends": [{"url": f"http://127.0.0.1:{backend_port}", "models": [MODEL]}],
        "media": {"allowed_domains": ["images.example.com"]},
        "health": {"interval": 5},
    }
    if state:
        cfg["state"] = state
    path.write_text(orjson.dumps(cfg).decode())  # JSON is YAML


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    ap.add_argument("--targets", default="direct,gateway,lmdeploy-proxy")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every target this many times, interleaved; the table gives medians and the ratios to the peers their range")
    local = ROOT / ".venv-lmdeploy" / "bin" / "lmdeploy"
    smg_local = ROOT / ".venv-smg" / "bin" / "smg"
    ap.add_argument("--smg", default=shutil.which("smg") or (str(smg_local) if smg_local.exists() else None),
                    help="the smg executable (SGLang model gateway) for its row (default: on PATH, or .venv-smg/bin)")
    ap.add_argument("--lmdeploy", default=shutil.which("lmdeploy") or (str(local) if local.exists() else None),
                    help="the lmdeploy executable for the proxy baseline (default: on PATH, or .venv-lmdeploy/bin)")
    ap.add_argument("--proxy-cpus", help="CPUs for each proxy under test, e.g. 0,1 (default: unpinned)")
    ap.add_argument("--load-cpus", help="CPUs for wrk, the backend and redis-server, e.g. 2-15 (default: unpinned)")
    ap.add_argument("--backend-workers", type=int, default=1, help="fake backend processes (SO_REUSEPORT): more when it is the limit")
    args = ap.parse_args()
    args.proxy_cpus, args.load_cpus = cpu_list(args.proxy_cpus), cpu_list(args.load_cpus)
    if args.proxy_cpus and args.load_cpus and args.proxy_cpus & args.load_cpus:
        sys.exit(f"--proxy-cpus and --load-cpus overlap on {sorted(args.proxy_cpus & args.load_cpus)}")
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (apt-get install wrk)")
    sys.path.insert(0, str(ROOT))
    from gateway.state.keys import new_key

    key = new_key()
    targets = args.targets.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello in one short sentence."}], "max_tokens": 16})
    stream_body = orjson.dumps(orjson.loads(body) | {"stream": True})
    rows: list[tuple[str, str, int, dict[str, float]]] = []
    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    backend_port = free_port()
    redis_port = None
    outer = contextlib.ExitStack()
    if any(t.startswith("gateway+redis") for t in targets):
        if shutil.which("redis-server") is None:
            sys.exit("redis-server is not installed (apt-get install redis-server)")
        redis_port = free_port()
        outer.enter_context(process(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], cpus=args.load_cpus))
        wait_port(redis_port)
    redis_pid = next((p for p in descendants(os.getpid()) if b"redis-server" in Path(f"/proc/{p}/cmdline").read_bytes()), None) if redis_port else None
    with outer, process([sys.executable, "bench/fake_backend.py", "--port", str(backend_port), "--model", MODEL,
                                 "--workers", str(args.backend_workers)], cpus=args.load_cpus):
        wait_http(f"http://127.0.0.1:{backend_port}/health")
        # Every target is started once and paused (SIGSTOP) while another is measured, so the
        # measurements interleave: each round measures every target at one mode and concurrency
        # in turn, and a drift in the shared machine's speed falls on all of them alike.
        started: list[tuple[str, str, str | None, int | None]] = []
        for target in targets:
            got = start_target(target, outer, args, tmp, backend_port, redis_port, key)
            if got is not None:
                started.append((target, *got))
                pause(got[2])
        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"round {rnd + 1} of {args.rounds}", flush=True)
            for mode, b in (("json", body), ("stream", stream_body)):
                for c in levels:
                    for target, url, k, pid in started:
                        resume(pid)
                        try:
                            r = measure(target, url, k, pid, mode, b, c, args.duration, redis_port, redis_pid, args.load_cpus)
                        finally:
                            pause(pid)
                        rows.append((target, mode, c, r))
    report(rows, args.rounds, args.proxy_cpus, args.load_cpus)


def pause(pid: int | None) -> None:
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGSTOP)


def resume(pid: int | None) -> None:
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)


def start_target(target: str, stack: contextlib.ExitStack, args: argparse.Namespace, tmp: Path, backend_port: int,
                 redis_port: int | None, key: str) -> tuple[str, str | None, int | None] | None:
    """Start one target; its process is stopped by ``stack``. Returns (url, key, pid), or None when skipped."""
    from gateway.state.keys import hash_key

    if target == "direct":
        return f"http://127.0.0.1:{backend_port}/v1/chat/completions", None, None
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    if target.startswith("gateway+"):
        variant = target[len("gateway+"):]
        # a prefix per target: targets sharing one would be replicas of each other (one's load seen by the other's balancer)
        state = {} if variant == "memory" else {"redis_url": f"redis://127.0.0.1:{redis_port}/0", "prefix": f"bench-{variant}"}
        cfg = tmp / f"state-{variant}.yaml"
        gateway_config(cfg, backend_port, hash_key(key), state=state, limits="-open" not in variant)
        workers = ["--workers", "2"] if variant.endswith("-w2") else ["--workers", "2", "--pin-workers"] if variant.endswith("-w2pin") else []
        pid = stack.enter_context(process([sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port), *workers], cpus=args.proxy_cpus)).pid
        for _ in range(20):  # fresh connections reach every worker: all of them must be up
            wait_http(f"http://127.0.0.1:{port}/ready", timeout=60)
        return url, key, pid
    if target == "gateway":
        cfg = tmp / "gateway.yaml"
        gateway_config(cfg, backend_port, hash_key(key))
        pid = stack.enter_context(process([sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)], cpus=args.proxy_cpus)).pid
        wait_http(f"http://127.0.0.1:{port}/ready")
        return url, key, pid
    if target == "smg":
        if not args.smg:
            print("smg: skipped (install it: python3 -m venv .venv-smg && .venv-smg/bin/pip install smg)")
            return None
        proc = stack.enter_context(process([args.smg, "launch", "--backend", "vllm", "--disable-tokenizer-autoload",
                                           "--worker-urls", f"http://127.0.0.1:{backend_port}", "--policy", "round_robin",
                                           "--host", "127.0.0.1", "--port", str(port),
                                           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"],
                                           cpus=args.proxy_cpus))
        try:
            wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=60, proc=proc)
        except RuntimeError as exc:
            print(f"smg: skipped ({exc})")
            return None
        return url, None, proc.pid
    if target == "lmdeploy-proxy":
        if not args.lmdeploy:
            print("lmdeploy-proxy: skipped (lmdeploy is not installed here)")
            return None
        proc = stack.enter_context(process([args.lmdeploy, "serve", "proxy", "--server-name", "127.0.0.1", "--server-port", str(port),
                                            "--routing-strategy", "min_expected_latency"], cpus=args.proxy_cpus))
        try:
            wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=180, proc=proc)  # it imports torch first
        except RuntimeError as exc:
            print(f"lmdeploy-proxy: skipped ({exc})")
            return None
        pid = proc.pid
        httpx.post(f"http://127.0.0.1:{port}/nodes/add", json={"url": f"http://127.0.0.1:{backend_port}", "status": {"models": [MODEL], "role": 1}})
        return url, None, pid
    sys.exit(f"unknown target {target}")


def measure(target: str, url: str, k: str | None, pid: int | None, mode: str, body: bytes, c: int, duration: float,
            redis_port: int | None, redis_pid: int | None, load_cpus: set[int] | None = None) -> dict[str, float]:
    """One wrk run after a 1-s warm-up (connections, caches, and the timers of a process just resumed)."""
    wrk(url, c, 1.0, body, k, load_cpus)
    redis_row = redis_port is not None and "redis" in target
    cpu0 = tree_cpu_seconds(pid) if pid else 0.0
    rcmd0 = redis_commands(redis_port) if redis_row else 0
    rcpu0 = cpu_seconds(redis_pid) if redis_row and redis_pid else 0.0
    r = wrk(url, c, duration, body, k, load_cpus)
    n = r["rps"] * max(1, int(duration))
    r["cpu_us"] = (tree_cpu_seconds(pid) - cpu0) / n * 1e6 if pid and n else float("nan")
    if redis_row and n:
        r["redis_cmds"] = (redis_commands(redis_port) - rcmd0) / n
        r["redis_cpu_us"] = (cpu_seconds(redis_pid) - rcpu0) / n * 1e6 if redis_pid else float("nan")
    print(f"  {target:22} {mode:6} c={c:<3} {r['rps']:9.0f} req/s  p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  cpu/req {r['cpu_us']:.0f} us  errors {r['errors']}", flush=True)
    if "redis_cmds" in r:  # after its own row, not above the next one's
        print(f"  {'':22} redis: {r['redis_cmds']:.2f} scripts/req (one per key per write: the admissions of one key asked for together share a call, and the settles that ended meanwhile ride in it), redis-server cpu/req {r['redis_cpu_us']:.0f} us", flush=True)
    return r


def report(rows: list[tuple[str, str, int, dict[str, float]]], rounds: int, proxy_cpus: set[int] | None = None,
           load_cpus: set[int] | None = None) -> None:
    """The table (medians over rounds when there are several), then each target's ratios to the peers."""
    runs: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for t, m, c, r in rows:
        runs.setdefault((t, m, c), []).append(r)
    med = {key: {f: statistics.median(r[f] for r in rs) for f in ("rps", "p50_ms", "p99_ms", "cpu_us")} | {"errors": sum(r["errors"] for r in rs)}
           for key, rs in runs.items()}
    title = f" (median of {rounds} interleaved rounds)" if rounds > 1 else ""
    print(f"\n{'target':22} {'mode':6} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'cpu us/req':>10} {'errors':>6}{title}")
    for (t, m, c), r in med.items():
        base = med.get(("direct", m, c))
        added = r["p50_ms"] - base["p50_ms"] if base else float("nan")
        print(f"{t:22} {m:6} {c:>4} {r['rps']:9.0f} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {added:10.3f} {r['cpu_us']:10.0f} {int(r['errors']):6d}")
    for peer in ("smg", "lmdeploy-proxy"):
        lines = []
        for (t, m, c), rs in runs.items():
            theirs = runs.get((peer, m, c))
            if t in ("direct", peer) or not theirs:
                continue
            tput = [a["rps"] / b["rps"] for a, b in zip(rs, theirs) if b["rps"]]
            cpu = [a["cpu_us"] / b["cpu_us"] for a, b in zip(rs, theirs) if b["cpu_us"] == b["cpu_us"] and b["cpu_us"]]
            spread = f" ({min(tput):.2f}-{max(tput):.2f})" if len(tput) > 1 else ""
            cpu_part = f"   cpu/req x{statistics.median(cpu):.2f}" + (f" ({min(cpu):.2f}-{max(cpu):.2f})" if len(cpu) > 1 else "") if cpu else ""
            lines.append(f"{t:22} {m:6} {c:>4}   req/s x{statistics.median(tput):.2f}{spread}{cpu_part}")
        if lines:
            print(f"\nagainst {peer}, each round's ratio (median, and range over rounds):")
            print("\n".join(lines))
    if proxy_cpus:
        print(f"\n{os.cpu_count()} CPU cores; each proxy on CPUs {sorted(proxy_cpus)}, load generator, backend and redis-server on "
              f"{sorted(load_cpus) if load_cpus else 'any'}.")
    else:
        print(f"\n{os.cpu_count()} CPU cores; load generator, backend and gateway share them.")
    print("cpu us/req: CPU time the proxy process spent per request (user + system), the cost that caps its throughput per core.")

if __name__ == "__main__":
    main()
