"""What a hostile backend costs the gateway: one request answered with a 300 MB body (no
Content-Length, the end is the connection's close), and one answered with a second, unsolicited
response pipelined behind the genuine one.

Prints, per gateway checkout given (``--baseline`` is another checkout, e.g. a worktree of an
older commit, run the same way in the same run), the status the client saw, the gateway's peak
RSS growth while it happened and how many bytes it took from the backend; and whether the
injected response reached the next client.

    python bench/untrusted.py [--baseline /path/to/older/checkout] [--mb 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend:
    """A raw socket backend: /health and /v1/models as lmdeploy; POSTs by ``mode``."""

    def __init__(self, mb: int):
        self.mb = mb
        self.mode = "huge"
        self.sent = 0
        self.posts = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self.serve, "127.0.0.1", 0))
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":")[1])
                await reader.readexactly(n)
                if head.startswith(b"GET /health"):
                    body = b'{"status": "healthy"}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                elif head.startswith(b"GET"):
                    body = b'{"data": [{"id": "m"}]}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                elif self.mode == "huge":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n")
                    block = b"x" * (1 << 20)
                    while self.sent < self.mb << 20:
                        writer.write(block)
                        self.sent += len(block)
                        await writer.drain()
                    writer.close()
                    return
                else:
                    self.posts += 1
                    ok = b'{"id": "genuine-%d"}' % self.posts
                    resp = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(ok), ok)
                    evil = b'{"id": "INJECTED"}'
                    extra = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(evil), evil)
                    writer.write(resp + (extra if self.posts == 1 else b""))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run_gateway(checkout: Path, backend: Backend) -> dict:
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "auth": {"disabled": True},
        "backends": [{"url": f"http://127.0.0.1:{backend.port}", "name": "b", "models": ["m"]}],
        "balancer": {"retries": 0},
        "health": {"interval": 0.2},
    }
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=d, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            base = rss_kib(proc.pid)
            backend.mode, backend.sent = "huge", 0
            peak = base
            done = threading.Event()

            def watch() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, rss_kib(proc.pid))
                    time.sleep(0.005)

            w = threading.Thread(target=watch)
            w.start()
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            took = time.monotonic() - t0
            done.set()
            w.join()
            status_huge, got = r.status_code, len(r.content)
            backend.mode, backend.posts = "pipelined", 0
            r1 = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            r2 = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            injected = b"INJECTED" in r1.content + r2.content
            return {"status": status_huge, "client_bytes": got, "rss_growth_mib": (peak - base) / 1024, "seconds": took,
                    "backend_sent_mib": backend.sent / (1 << 20), "injected_reached_client": injected}  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(15)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to run the same way, side by side")
    ap.add_argument("--mb", type=int, default=300)
    args = ap.parse_args()
    backend = Backend(args.mb)
    targets = [("this", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
    print(f"{'checkout':<10} {'status':>6} {'client MiB':>10} {'backend MiB':>11} {'RSS +MiB':>9} {'s':>6}  injected->client")
    for name, checkout in targets:
        r = run_gateway(checkout, backend)
        print(f"{name:<10} {r['status']:>6} {r['client_bytes'] / (1 << 20):>10.1f} {r['backend_sent_mib']:>11.1f} "
              f"{r['rss_growth_mib']:>9.1f} {r['seconds']:>6.2f}  {r['injected_reached_client']}")  # fmt: skip


if __name__ == "__main__":
    main()
