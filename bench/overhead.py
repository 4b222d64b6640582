"""What the gateway adds on top of a backend, measured side by side in one run.

Targets, all against the same very fast fake backend (bench/fake_backend.py):
  direct            the backend itself: the limit
  gateway                  auth, path/body/media policy, balancer, our HTTP/1.1 client (the default)
  gateway[aiohttp]         the same with an aiohttp ClientSession
  (the httpx transports were dropped: they cannot enforce response framing, see gateway/upstream.py)
  lmdeploy-proxy    `lmdeploy serve proxy`, when lmdeploy is installed

Load comes from wrk (Debian package `wrk`), at concurrency 1 and 32, non-streaming and streaming.

The proxy baseline needs lmdeploy, which needs no GPU to proxy; without CUDA wheels it installs
like this (a separate, git-ignored venv; the imports pull torch):

    python3 -m venv .venv-lmdeploy
    .venv-lmdeploy/bin/pip install --no-deps lmdeploy
    .venv-lmdeploy/bin/pip install torch fastapi fire mmengine-lite numpy "pydantic>2" shortuuid \
        transformers uvicorn aiohttp requests prometheus_client pillow safetensors sentencepiece \
        tiktoken einops partial_json_parser openai pybase64 pyzmq cloudpickle protobuf psutil openai_harmony

    python bench/overhead.py [--duration 5] [--targets direct,gateway,gateway[aiohttp]]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
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


def wait_http(url: str, timeout: float = 30.0, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, headers=headers, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


@contextlib.contextmanager
def process(argv: list[str], **kw):
    proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def wrk(url: str, concurrency: int, duration: float, body: bytes, key: str | None) -> dict[str, float]:
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
            capture_output=True, text=True, timeout=duration + 60,
        ).stdout
    finally:
        os.unlink(script)
    m = re.search(r"RESULT (\d+) (\d+) (\d+) ([\d.]+) ([\d.]+) ([\d.]+)", out)
    if not m:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    n, errors, dur_us, p50, p99, mean = m.groups()
    return {"rps": int(n) / (int(dur_us) / 1e6), "errors": int(errors), "p50_ms": float(p50) / 1000, "p99_ms": float(p99) / 1000}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: a cost per request that other load on the machine does not distort."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_config(path: Path, backend_port: int, key_hash: str, transport: str) -> None:
    cfg = {
        "server": {"log_level": "warning"},
        "auth": {"keys": [{"name": "bench", "hash": key_hash}]},
        "backends": [{"url": f"http://127.0.0.1:{backend_port}", "models": [MODEL]}],
        "upstream": {"transport": transport},
        "media": {"allowed_domains": ["images.example.com"]},
        "health": {"interval": 5},
    }
    path.write_text(orjson.dumps(cfg).decode())  # JSON is YAML


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    ap.add_argument("--targets", default="direct,gateway,gateway[aiohttp],lmdeploy-proxy")
    ap.add_argument("--concurrency", default="1,32")
    local = ROOT / ".venv-lmdeploy" / "bin" / "lmdeploy"
    ap.add_argument("--lmdeploy", default=shutil.which("lmdeploy") or (str(local) if local.exists() else None),
                    help="the lmdeploy executable for the proxy baseline (default: on PATH, or .venv-lmdeploy/bin)")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (apt-get install wrk)")
    sys.path.insert(0, str(ROOT))
    from gateway.filters.auth import hash_key, new_key

    key = new_key()
    targets = args.targets.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello in one short sentence."}], "max_tokens": 16})
    stream_body = orjson.dumps(orjson.loads(body) | {"stream": True})
    rows: list[tuple[str, str, int, dict[str, float]]] = []
    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    backend_port = free_port()
    with process([sys.executable, "bench/fake_backend.py", "--port", str(backend_port), "--model", MODEL]):
        wait_http(f"http://127.0.0.1:{backend_port}/health")
        for target in targets:
            stack = contextlib.ExitStack()
            pid = None
            with stack:
                if target == "direct":
                    url, k = f"http://127.0.0.1:{backend_port}/v1/chat/completions", None
                elif target.startswith("gateway"):
                    transport = target[len("gateway["):-1] if "[" in target else "native"
                    port = free_port()
                    cfg = tmp / f"{transport}.yaml"
                    gateway_config(cfg, backend_port, hash_key(key), transport)
                    pid = stack.enter_context(process([sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)])).pid
                    wait_http(f"http://127.0.0.1:{port}/ready")
                    url, k = f"http://127.0.0.1:{port}/v1/chat/completions", key
                elif target == "lmdeploy-proxy":
                    if not args.lmdeploy:
                        print("lmdeploy-proxy: skipped (lmdeploy is not installed here)")
                        continue
                    port = free_port()
                    pid = stack.enter_context(process([args.lmdeploy, "serve", "proxy", "--server-name", "127.0.0.1", "--server-port", str(port), "--routing-strategy", "min_expected_latency"])).pid
                    wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=180)  # it imports torch first
                    httpx.post(f"http://127.0.0.1:{port}/nodes/add", json={"url": f"http://127.0.0.1:{backend_port}", "status": {"models": [MODEL], "role": 1}})
                    url, k = f"http://127.0.0.1:{port}/v1/chat/completions", None
                else:
                    sys.exit(f"unknown target {target}")
                for mode, b in (("json", body), ("stream", stream_body)):
                    for c in levels:
                        wrk(url, c, 1.0, b, k)  # warm-up: connections, caches
                        cpu0 = cpu_seconds(pid) if pid else 0.0
                        r = wrk(url, c, args.duration, b, k)
                        n = r["rps"] * max(1, int(args.duration))
                        r["cpu_us"] = (cpu_seconds(pid) - cpu0) / n * 1e6 if pid and n else float("nan")
                        rows.append((target, mode, c, r))
                        print(f"  {target:22} {mode:6} c={c:<3} {r['rps']:9.0f} req/s  p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  cpu/req {r['cpu_us']:.0f} us  errors {r['errors']}", flush=True)
    base = {(m, c): r for t, m, c, r in rows if t == "direct"}
    print(f"\n{'target':22} {'mode':6} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'cpu us/req':>10} {'errors':>6}")
    for t, m, c, r in rows:
        added = r["p50_ms"] - base[(m, c)]["p50_ms"] if (m, c) in base else float("nan")
        print(f"{t:22} {m:6} {c:>4} {r['rps']:9.0f} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {added:10.3f} {r['cpu_us']:10.0f} {r['errors']:6d}")
    print(f"\n{os.cpu_count()} CPU cores; load generator, backend and gateway share them.")
    print("cpu us/req: CPU time the proxy process spent per request (user + system), the cost that caps its throughput per core.")


if __name__ == "__main__":
    main()
