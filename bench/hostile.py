"""Hostile clients, before and after, in one run: CPU seconds and peak RSS of the gateway process.

  before   the gateway at a baseline commit (default 993234e: uvicorn, the old header join and
           body checks), unpacked from git into a temporary folder and run with this venv
  after    the gateway in this checkout (our HTTP/1.1 server)

Attacks, each against a fresh gateway process (so its peak RSS is the attack's):
  headers    one request with N repeated header lines (default 10,000 x 200 B = 2 MB; the
             issue's 40,000 took 82 s on the baseline: the cost is quadratic)
  body-dup   a 32 MB body of small objects whose last key repeats the first (the baseline's
             slow duplicate-key scan runs over all of it), with a valid key
  body-cap   the same shape with fewer, larger objects: under limits.max_json_values
  idle-flood 1.2 x the open-files limit (1024 here) of idle connections, then 20 new requests:
             how many were served, and how many idle sockets the gateway still held

    python bench/hostile.py [--quick] [--baseline 993234e] [--only after]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from io import BytesIO
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
FLOOD_NOFILE = 1024  # what a systemd service gets by default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def health(port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


@contextlib.contextmanager
def gateway(code_dir: Path, cfg_path: Path, port: int, nofile: int | None = None):
    def limit() -> None:
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    env = dict(os.environ, PYTHONPATH=str(code_dir))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(cfg_path), "--port", str(port)],
        cwd=code_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=limit, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not health(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway in {code_dir} did not start")
            time.sleep(0.1)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def exchange(port: int, payload: bytes, timeout: float) -> tuple[bytes, float]:
    """Send payload (in a thread) and read the answer; (status line, seconds until it came)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        def send() -> None:
            with contextlib.suppress(OSError):
                s.sendall(payload)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        try:
            first = s.recv(64)
        except (socket.timeout, ConnectionResetError):
            first = b""
        elapsed = time.monotonic() - started
        t.join(5)
    return first.split(b"\r\n", 1)[0], elapsed


def attack(code_dir: Path, cfg: Path, payload: bytes, timeout: float) -> dict[str, object]:
    port = free_port()
    with gateway(code_dir, cfg, port) as proc:
        cpu0, rss0 = cpu_seconds(proc.pid), proc_status(proc.pid, "VmRSS")
        status, elapsed = exchange(port, payload, timeout)
        cpu = cpu_seconds(proc.pid) - cpu0
        peak = proc_status(proc.pid, "VmHWM")
    return {"status": status.decode(errors="replace") or f"no answer within {timeout:.0f} s", "cpu": cpu, "peak": peak, "rss0": rss0, "wall": elapsed}


def idle_flood(code_dir: Path, cfg: Path) -> dict[str, int]:
    port = free_port()
    n = int(FLOOD_NOFILE * 1.2)
    socks: list[socket.socket] = []
    with gateway(code_dir, cfg, port, nofile=FLOOD_NOFILE) as proc:
        try:
            for _ in range(n):
                try:
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                except OSError:
                    break
            time.sleep(0.5)  # let the gateway accept what it will
            held = sum(1 for fd in os.listdir(f"/proc/{proc.pid}/fd") if os.readlink(f"/proc/{proc.pid}/fd/{fd}").startswith("socket:"))
            served = sum(1 for _ in range(20) if health(port, timeout=1.0))
        finally:
            for s in socks:
                s.close()
    return {"flood": len(socks), "held": held, "served": served}


def baseline_tree(commit: str, into: Path) -> Path:
    data = subprocess.run(["git", "archive", commit, "gateway"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into)
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="993234e", help="git commit of the 'before' gateway")
    ap.add_argument("--header-lines", type=int, default=10_000)
    ap.add_argument("--quick", action="store_true", help="5,000 header lines, no idle flood")
    ap.add_argument("--only", choices=("before", "after"), default=None)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one answer")
    args = ap.parse_args()
    lines = 5_000 if args.quick else args.header_lines
    sys.path.insert(0, str(ROOT))
    from gateway.state.keys import hash_key, new_key

    key = new_key()
    tmp = Path(tempfile.mkdtemp(prefix="gw-hostile-"))
    backend = free_port()  # nothing listens: every attack is answered before a backend is needed
    cfg = tmp / "gw.json"
    cfg.write_bytes(orjson.dumps({
        "server": {"log_level": "error"},
        "auth": {"keys": [{"name": "bench", "hash": hash_key(key)}]},
        "backends": [{"url": f"http://127.0.0.1:{backend}", "models": ["m"]}],
        "health": {"interval": 60},
    }))
    head = b"GET /health HTTP/1.1\r\nHost: b\r\n" + (b"X-A: " + b"a" * 200 + b"\r\n") * lines + b"\r\n"

    def body_request(count: int, content: str) -> bytes:
        raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}] * count})
        raw = raw[: 32 * MIB - 64]
        raw = raw[: raw.rfind(b"},") + 1] + b'], "model": "m"}'
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: b\r\nAuthorization: Bearer " + key.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)

    attacks = {
        f"headers ({lines} lines, {len(head) / MIB:.1f} MB)": head,
        "body-dup (32 MB, 1.1M small objects)": body_request(1_100_000, "hi"),
        "body-cap (32 MB, 80k objects)": body_request(80_000, "hello there, " * 30),
    }
    sides: list[tuple[str, Path]] = []
    try:
        if args.only != "after":
            sides.append((f"before ({args.baseline}, uvicorn)", baseline_tree(args.baseline, tmp / "baseline")))
        if args.only != "before":
            sides.append(("after (this checkout)", ROOT))
        rows = []
        for name, payload in attacks.items():
            for side, code in sides:
                r = attack(code, cfg, payload, args.timeout)
                rows.append((name, side, r))
                print(f"  {name:38} {side:28} cpu {r['cpu']:7.2f} s  peak RSS {r['peak'] / MIB:7.0f} MiB  {r['status']}", flush=True)
        floods = [] if args.quick else [(side, idle_flood(code, cfg)) for side, code in sides]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{'attack':38} {'gateway':28} {'cpu s':>7} {'peak RSS MiB':>12} {'start RSS':>9}  answer")
    for name, side, r in rows:
        print(f"{name:38} {side:28} {r['cpu']:7.2f} {r['peak'] / MIB:12.0f} {r['rss0'] / MIB:9.0f}  {r['status']}")
    if floods:
        print(f"\nidle flood under an open-files limit of {FLOOD_NOFILE}:")
        print(f"{'gateway':28} {'idle sockets opened':>19} {'held by gateway':>15} {'new requests served':>20}")
        for side, f in floods:
            print(f"{side:28} {f['flood']:19d} {f['held']:15d} {str(f['served']) + '/20':>20}")
    print(f"\n{os.cpu_count()} CPU cores; cpu = user + system seconds of the gateway process for that one request.")


if __name__ == "__main__":
    main()
